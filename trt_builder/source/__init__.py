"""The input model: what --model names and its revision, the hub, fetching it into hf/ (the fetch stage), and loading its config, tokenizer and transformers model."""
