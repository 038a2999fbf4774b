"""Triton python model `tensorrt_llm`: the reference backend. A PyTorch reference, not
TensorRT-LLM: it executes the TensorRT-LLM checkpoint copied beside it with trt-builder's
checkpoint runtime, behind the tensorrtllm backend's inputs, outputs and parameters, with
in-flight batching (trt_builder.runtimes.batching). Written for trt-builder, for hosts where no
engine exists.

The model runs in a model process of its own (trt_builder.runtimes.model_process), started by
this one: if it dies, each request it held ends with an UNAVAILABLE error naming the death, and
the next request starts it again.

Requests join the running batch as they arrive, in streaming (decoupled) repositories and in
the others: execute() returns at once and the answers go through each request's response
sender. In a decoupled repository each token is sent as it comes when the request asks to
stream; a non-decoupled one refuses `streaming`, as the tensorrtllm backend does.
"""

import json
import queue
import threading
import time
from pathlib import Path

import numpy as np


def words(value):
    """TensorRT-LLM's [2, L] word list (flattened ids, then end offsets, -1 padded) as tuples."""
    if value is None:
        return ()
    value = np.asarray(value).reshape(2, -1)
    ids, offsets = value[0].tolist(), [int(o) for o in value[1].tolist() if o >= 0]
    out, start = [], 0
    for end in offsets:
        if end > start:
            out.append(tuple(int(i) for i in ids[start:end]))
        start = end
    return tuple(out)


def scalar(inputs, name, kind, default):
    value = inputs.get(name)
    return default if value is None else kind(np.asarray(value).reshape(-1)[0])


def make_request(inputs, vocab_size, max_seq_len=0):
    """A batching.Request and whether to stream, from one request's input arrays (by name);
    ValueError for what the model cannot run (`max_seq_len`: the build's, as an engine holds
    it; 0 for no limit), before it joins the batch."""
    from trt_builder.runtimes.requests import Request, Sampling

    ids = np.asarray(inputs["input_ids"])
    if ids.ndim > 1 and ids.shape[0] > 1:
        raise ValueError(
            f"one prompt per request: this one holds {ids.shape[0]} (send them as separate requests)"
        )
    ids = ids.reshape(-1)
    length = scalar(inputs, "input_lengths", int, ids.size)
    used = [int(i) for i in ids[:length]]
    for name in ("bad_words_list", "stop_words_list"):
        used += [int(i) for word in words(inputs.get(name)) for i in word]
    bad = [i for i in used if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    sampling = Sampling(
        top_k=scalar(inputs, "runtime_top_k", int, 0),
        top_p=scalar(inputs, "runtime_top_p", float, 0.0),
        temperature=scalar(inputs, "temperature", float, 1.0),
        seed=scalar(inputs, "seed", int, 0),
    )
    output_len = scalar(inputs, "request_output_len", int, 0)
    if max_seq_len and length + output_len > max_seq_len:
        raise ValueError(
            f"prompt ({length} tokens) + request_output_len ({output_len}) exceeds the build's "
            f"max_seq_len {max_seq_len}: lower request_output_len or shorten the prompt"
        )
    request = Request(
        prompt=tuple(int(i) for i in ids[:length]),
        max_new_tokens=output_len,
        end_id=scalar(inputs, "end_id", int, None),
        stop_words=words(inputs.get("stop_words_list")),
        bad_words=words(inputs.get("bad_words_list")),
        sampling=sampling,
    )
    return request, scalar(inputs, "streaming", bool, False)


#: Seconds between two questions to Triton of which requests were cancelled.
CANCEL_POLL_S = 0.1


def _is_cancelled(request):
    """Triton's cancellation flag for a request (the Python backend has had it since 23.10)."""
    try:
        return bool(request.is_cancelled())
    except Exception:  # an older backend, or a request Triton has released
        return False


INPUTS = ("input_ids", "input_lengths", "request_output_len", "end_id", "pad_id",
          "runtime_top_k", "runtime_top_p", "temperature", "seed", "streaming",
          "stop_words_list", "bad_words_list", "stop")  # fmt: skip


class TritonPythonModel:
    #: The inputs _inputs reads (a subclass names its own).
    INPUTS: tuple[str, ...] = INPUTS

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        here = Path(args["model_repository"]) / args["model_version"]
        batcher = self._model_process(args, here / params.get("checkpoint_dir", "checkpoint"),
                                      params, int(config["max_batch_size"]))  # fmt: skip
        pb_utils.Logger.log_info(
            "tensorrt_llm: trt-builder's reference backend (PyTorch, not TensorRT-LLM) on "
            f"{batcher.device}, in model process {batcher.pid}"
        )
        self.vocab_size = batcher.vocab_size
        self.max_seq_len = int(params.get("max_seq_len") or 0)  # older repositories: none
        self._start(config, batcher)

    @staticmethod
    def _model_process(args, checkpoint, params, max_batch_size):
        """The model process that runs `checkpoint` (named after this model instance);
        TritonModelException with its reason if it fails to load."""
        import triton_python_backend_utils as pb_utils

        from trt_builder.runtimes.model_process import ModelProcess

        try:
            return ModelProcess(args["model_instance_name"], checkpoint,
                                params.get("device", "auto"), max_batch_size)  # fmt: skip
        except RuntimeError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None

    def _start(self, config, batcher):
        """The batch and its worker thread (the llmapi model's initialize ends here too)."""
        import triton_python_backend_utils as pb_utils

        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.batcher = batcher
        # execute() only puts requests here; the worker alone touches the batch, so a request
        # is never held up behind another's step
        self.inbox = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stopping = False
        self.polled = 0.0  # when _cancelled last asked
        self.active = {}  # request id -> (response sender, stream, tokens, Triton's request)
        self.worker = threading.Thread(target=self._loop, daemon=True)
        self.worker.start()

    def _inputs(self, request):
        import triton_python_backend_utils as pb_utils

        found = {}
        for name in self.INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                found[name] = tensor.as_numpy()
        return found

    def _submit(self, request, sender):
        inputs = self._inputs(request)
        if scalar(inputs, "stop", bool, False):  # the tensorrtllm backend's stop request
            if not request.request_id():
                raise ValueError("Trying to stop a request but request ID is not provided")
            self.inbox.put((None, sender, False, request))
            self.wake.set()
            return
        parsed, stream = make_request(inputs, self.vocab_size, self.max_seq_len)
        if stream and not self.decoupled:  # the tensorrtllm backend's refusal, in its words
            raise ValueError(
                "Streaming is only supported if model is deployed using decoupled mode "
                "(package the repository with [triton] streaming = true)"
            )
        self.inbox.put((parsed, sender, stream, request))
        self.wake.set()

    def _admit(self):
        """Move what execute() received into the batch (the worker's thread)."""
        while True:
            try:
                parsed, sender, stream, request = self.inbox.get_nowait()
            except queue.Empty:
                return
            if parsed is None:
                self._stop(request.request_id(), sender)
                continue
            rid = self._join(parsed, sender)
            if rid is not None:
                self.active[rid] = (sender, stream, [], request)

    def _join(self, parsed, sender):
        """Submit a parsed request to the batch: its id, or None when the model process could
        not be started again (the request has heard why)."""
        try:
            return self.batcher.submit(parsed)
        except RuntimeError as exc:
            self._fail([sender], f"the model could not be loaded again: {exc}", "UNAVAILABLE")
            return None

    def _stop(self, request_id, sender):
        """A stop request, as the tensorrtllm backend answers one (handleStopRequest: the
        executor's cancelRequest for each request with its id, then an empty final response,
        also when none was running, as it may have just finished). A stopped request's stream
        ends there: a final response without an error, as the executor ends a cancelled one;
        in a repository that does not stream, the one response a request must get: its tokens
        so far."""
        import triton_python_backend_utils as pb_utils

        gone = [rid for rid, entry in self.active.items() if entry[3].request_id() == request_id]
        for rid in gone:
            self.batcher.cancel(rid)
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        ends = []
        for rid in gone:
            to, _, tokens, _ = self.active.pop(rid)
            ends.append((to, None if self.decoupled else self._response(tokens)))
        ends.append((sender, pb_utils.InferenceResponse(output_tensors=[])))
        for to, response in ends:
            try:
                to.send(response, flags=final)
            except Exception:  # its client is gone
                pass

    def execute(self, requests):
        """Hand each request to the batch and return at once, in both transaction policies:
        the answers go through each request's response sender (a non-decoupled model may use
        it for its one response), so requests join the running batch as they arrive."""
        import triton_python_backend_utils as pb_utils

        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as exc:  # a refused request: its own error, the rest go on
                sender.send(self._refusal(str(exc)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # fmt: skip
        return None

    @staticmethod
    def _refusal(message):
        """The response to a request refused before it joins the batch."""
        import triton_python_backend_utils as pb_utils

        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))

    @staticmethod
    def _response(tokens):
        import triton_python_backend_utils as pb_utils

        ids = np.array([[tokens]], dtype=np.int32).reshape(1, 1, -1)
        length = np.array([[len(tokens)]], dtype=np.int32)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("output_ids", ids), pb_utils.Tensor("sequence_length", length)])  # fmt: skip

    def _fail(self, senders, message, code=None):
        """Answer requests with an error (their last response), of Triton's `code` (its name:
        "CANCELLED", "UNAVAILABLE") if given and this backend has it."""
        import triton_python_backend_utils as pb_utils

        code = getattr(pb_utils.TritonError, code, None) if code else None
        for sender in senders:
            failure = pb_utils.TritonError(message, *(() if code is None else (code,)))
            error = pb_utils.InferenceResponse(error=failure)
            try:
                sender.send(error, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # its client is gone: nothing more to tell it
                pass

    def _send(self, event, sender, stream, tokens):
        """The responses one event makes: a streamed token, the final one."""
        import triton_python_backend_utils as pb_utils

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if stream:
            sender.send(self._response([event.token]))
            if event.finished:
                sender.send(flags=final)
        elif event.finished:
            sender.send(self._response(tokens), flags=final)

    def _cancelled(self):
        """Drop the requests Triton reports cancelled (a gRPC stream cancelled, a deadline
        passed, a client gone); each hears a final CANCELLED error if it can still hear. Asked
        at most every CANCEL_POLL_S (each question is a round trip to the server process)."""
        now = time.monotonic()
        if now - self.polled < CANCEL_POLL_S:
            return
        self.polled = now
        gone = [rid for rid, entry in self.active.items() if _is_cancelled(entry[3])]
        senders = []
        for rid in gone:
            senders.append(self.active.pop(rid)[0])
            self.batcher.cancel(rid)
        self._fail(senders, "cancelled", "CANCELLED")

    def _loop(self):
        import triton_python_backend_utils as pb_utils

        from trt_builder.runtimes.requests import StepFailed

        while not self.stopping:
            self._admit()
            self._cancelled()
            if self.batcher.idle:
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            try:
                events = self.batcher.step()
            except StepFailed as exc:  # only the requests in the failed step hear it (all of
                # them when the model process died)
                failed = [self.active.pop(rid)[0] for rid in exc.requests if rid in self.active]
                self._fail(failed, str(exc), exc.code)
                if exc.code:
                    pb_utils.Logger.log_error(f"tensorrt_llm: {exc}")
                continue
            for event in events:
                sender, stream, tokens, _ = self.active[event.request]
                tokens.append(event.token)
                if event.finished:
                    del self.active[event.request]
                try:
                    self._send(event, sender, stream, tokens)
                except Exception:  # a client that went away: drop its request, serve the rest
                    self.active.pop(event.request, None)
                    self.batcher.cancel(event.request)

    def finalize(self):
        self.stopping = True
        self.wake.set()
        self.worker.join(timeout=5)
        self._admit()
        pending, self.active = self.active, {}
        self._fail([entry[0] for entry in pending.values()], "the model is being unloaded")
        self.batcher.close()
