"""Triton python model `ensemble` (and `tensorrt_llm_bls`, upstream's name, in a streaming
repository): the ensemble's request, answered through preprocessing and tensorrt_llm by Business
Logic Scripting, with the text detokenized as one stream. Written for trt-builder (upstream's
tensorrtllm_backend has a model named tensorrt_llm_bls of the same purpose; this one is not its
code).

Why not Triton's ensemble scheduler, in 2.51 and since (core's ensemble_scheduler.cc):
- it runs postprocessing once per streamed response, with nothing that ties one response to
  the next, so each piece is decoded alone and a character whose bytes span two tokens arrives
  as U+FFFD. Here one thread sees a request's whole stream: each piece is what the decode of all
  tokens so far adds, held back while it ends in an incomplete character or in whitespace
  (which a tokenizer's clean-up may still take back), so the pieces concatenate to exactly the
  decode of the whole answer, which is what a request without streaming gets;
- it never tells a running step that its client left (the step runs to its end), and a
  request whose step's stub died ended as an empty success. This model watches its own
  response sender and the tensorrt_llm model's processes while it waits (_watched).
"""

import json
import os
import queue
import threading
import time
import uuid
from pathlib import Path

import numpy as np

TRUE = ("true", "1", "yes", "y", "t", "on")
REPLACEMENT = "\ufffd"
#: Seconds between two looks, while a stream waits for its next token, at whether the client
#: left and whether the tensorrt_llm model's process is alive.
WATCH_S = 0.1
#: Seconds a request waits, once its model's process is seen dead, for that model's own error
#: (which names the signal) before it tells the death itself: which comes first is a race.
GRACE_S = 2.0
#: The Python backend's stub, as /proc names it (15 characters kept).
STUB_COMM = "triton_python_backend_stub"[:15]
#: The command line's module of the reference backend's model process (trt-builder's
#: runtimes/model_process.py; not imported: this model also runs where trt-builder is not).
MODEL_PROCESS = "trt_builder.runtimes.model_process"
#: Seconds the unload waits, in all, for the requests still being answered.
FINALIZE_S = 5.0


def model_processes(model):
    """{pid: (model instance, what it is, model version)} of the processes in this process
    group (this server's) that a request to `model` depends on: the Python-backend stubs that
    run it (each version's), and the model processes those stubs started (the reference
    backend's, running PyTorch). Empty for a model of another backend (the tensorrtllm backend
    runs in tritonserver)."""
    stubs, workers = {}, {}
    group = os.getpgrp()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text.rsplit(")", 1)[1].split()
            if int(fields[2]) != group:
                continue
            comm = text[text.index("(") + 1 : text.rindex(")")]
            argv = [
                a.decode(errors="replace")
                for a in (stat.parent / "cmdline").read_bytes().split(b"\0")
            ]
        except (OSError, IndexError, ValueError):
            continue  # it exited while being read
        pid = int(stat.parent.name)
        # a stub's argv: stub, <repository>/<model>/<version>/model.py, ..., its instance
        if comm == STUB_COMM and len(argv) > 8 and Path(argv[1]).parts[-3:-2] == (model,):
            stubs[pid] = (argv[8], "Python-backend stub", Path(argv[1]).parts[-2])
        elif MODEL_PROCESS in argv and argv.index(MODEL_PROCESS) + 1 < len(argv):
            workers[pid] = (int(fields[1]), argv[argv.index(MODEL_PROCESS) + 1])
    found = dict(stubs)
    for pid, (parent, instance) in workers.items():
        if parent in stubs:
            found[pid] = (instance, "PyTorch", stubs[parent][2])
    return found


def dead(pids):
    """Those of `pids` whose process has died (gone, or a zombie not yet reaped)."""
    found = []
    for pid in list(pids):
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            found.append(pid)
            continue
        if text.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            found.append(pid)
    return found


class TextStream:
    """The text of a growing list of token ids, given out in pieces whose concatenation is
    `tokenizer.decode(all ids)`: a piece is what the decode of the ids so far adds to what was
    given, less any trailing U+FFFD (an incomplete UTF-8 sequence the next token may finish) and
    trailing whitespace (that clean-up of tokenization spaces may remove once the next token
    comes). `finish()` gives the rest, exactly."""

    def __init__(self, tokenizer, *, skip_special_tokens):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = []
        self.sent = ""

    def _decode(self):
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids):
        """Take the next ids; the piece of text they complete (may be empty)."""
        self.ids.extend(int(i) for i in ids)
        text = self._decode()
        if not text.startswith(self.sent):  # an earlier piece is being rewritten: wait
            return ""
        end = len(text)
        while end > len(self.sent) and (text[end - 1] == REPLACEMENT or text[end - 1].isspace()):
            end -= 1
        piece = text[len(self.sent) : end]
        self.sent += piece
        return piece

    def finish(self):
        """The rest of the answer. ValueError if the tokenizer's decode of the whole answer
        does not begin with the pieces already given (a decode that is not prefix-stable)."""
        text = self._decode()
        if not text.startswith(self.sent):
            raise ValueError(
                "the tokenizer's decode of the whole answer rewrote text already streamed"
            )
        piece = text[len(self.sent) :]
        self.sent = text
        return piece


class StepError(Exception):
    """A step's error response, passed on with its Triton error code (a refusal stays a 4xx)."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


def _scalar(request, name, default):
    import triton_python_backend_utils as pb_utils

    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils
        from transformers import AutoTokenizer

        config = json.loads(args["model_config"])
        # as tensorrt_llm's (the repository's): streamed answers, or one response per request
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        path = Path(params["tokenizer_dir"])
        path = path if path.is_absolute() else Path(args["model_repository"]) / path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.skip_special_tokens = params.get("skip_special_tokens", "true").lower() in TRUE
        # upstream's switch: each response carries all the text so far, not the new piece
        self.accumulate = params.get("accumulate_tokens", "false").lower() in TRUE
        # the ensemble's first two steps, as data: (model, {its input: tensor}, {its output:
        # tensor}); tensors named in neither come from this model's own request
        steps = json.loads(params["steps"])
        self.steps = [[model, inputs, outputs] for model, inputs, outputs in steps]
        self.steps[-1][0] = params.get("tensorrt_llm_model_name") or self.steps[-1][0]
        self.threads = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            with self.lock:
                self.threads.add(thread)
            thread.start()
        return None

    def finalize(self):
        """Wait for the requests being answered, FINALIZE_S in all (a stream whose model died
        holds its thread: the unload must not wait for it)."""
        with self.lock:
            threads = list(self.threads)
        deadline = time.monotonic() + FINALIZE_S
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _serve(self, request):
        import triton_python_backend_utils as pb_utils

        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            self._answer(request, sender)
        except Exception as exc:  # a refusal from a step, or a fault here: the client hears it
            code = getattr(exc, "code", None)
            error = pb_utils.TritonError(str(exc), *(() if code is None else (code,)))
            try:
                sender.send(pb_utils.InferenceResponse(error=error), flags=final)
            except Exception:  # its client is gone
                pass
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def _answer(self, request, sender):
        import triton_python_backend_utils as pb_utils

        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        tensors = {}  # ensemble tensor name -> numpy value
        for model, inputs, outputs in self.steps[:-1]:
            response = self._step(request, model, inputs, outputs, tensors).exec()
            self._check(response)
            self._gather(response, outputs, tensors)
        model, inputs, outputs = self.steps[-1]
        streaming = bool(_scalar(request, "stream", False))
        text = TextStream(self.tokenizer, skip_special_tokens=self.skip_special_tokens)
        ids_name = next(k for k, v in outputs.items() if v == "_TOKENS_BATCH")
        length_name = next(k for k, v in outputs.items() if v == "_SEQUENCE_LENGTH")
        # a streaming model always streams to us (a model that does not refuses a client's
        # `stream` in its own words); the request's own id is what a stop request names
        if self.decoupled:
            tensors["stream"] = np.array([[True]])
        child = f"bls-{uuid.uuid4().hex}"
        step = self._step(request, model, inputs, outputs, tensors, request_id=child)
        for response in self._watched(step, model, child, sender):
            self._check(response)
            ids = pb_utils.get_output_tensor_by_name(response, ids_name)
            if ids is None:  # the final, empty response of a stream
                continue
            ids = ids.as_numpy().reshape(-1)
            length = pb_utils.get_output_tensor_by_name(response, length_name)
            if length is not None:
                ids = ids[: int(length.as_numpy().reshape(-1)[0])]
            piece = text.add(ids)
            if streaming and piece:
                sender.send(self._text(text.sent if self.accumulate else piece))
        rest = text.finish()
        if streaming and not rest:
            sender.send(flags=final)
        else:
            out = text.sent if self.accumulate or not streaming else rest
            sender.send(self._text(out), flags=final)

    def _watched(self, step, model, child, sender):
        """The responses of `step` (the tensorrt_llm request `child`) as they come, watched
        between them every WATCH_S: a client that left (a gRPC stream cancelled, an HTTP
        connection closed, a deadline passed) stops the request within a step, and a process
        of the tensorrt_llm model that died (its stub, or the reference backend's model
        process) ends it with UNAVAILABLE naming it. Triton would not say it: the Python
        backend never answers a dead stub's decoupled requests (through Triton's ensemble
        they ended as empty successes), and an error response that a decoupled model sends
        after its first responses never reaches a BLS caller in 2.51 (measured: the stream
        just stops)."""
        import triton_python_backend_utils as pb_utils

        watched = model_processes(model)  # the processes this request depends on, now
        responses = step.exec(decoupled=True) if self.decoupled else None
        came = queue.Queue()

        def read():  # the answer blocks: wait for it here, watch in the caller
            try:
                if responses is None:
                    came.put(step.exec())
                else:
                    for response in responses:
                        came.put(response)
            finally:
                came.put(None)

        threading.Thread(target=read, daemon=True).start()
        seen = None  # when a death was first seen: the model's own error may still come
        while True:
            try:
                response = came.get(timeout=WATCH_S)
            except queue.Empty:
                response = False
            if response is None:  # the stream ended: whole, unless its model died meanwhile
                self._alive(model, watched)
                return
            if sender.is_cancelled():
                self._stop(model, child, responses, self.decoupled)  # the reader drains it
                raise StepError("cancelled", pb_utils.TritonError.CANCELLED)
            if response is False:
                if seen is None:
                    seen = time.monotonic() if self._death(model, watched) else None
                elif time.monotonic() - seen > GRACE_S:
                    self._alive(model, watched)
                continue
            yield response

    @classmethod
    def _alive(cls, model, watched):
        """StepError (UNAVAILABLE) naming the first of the `watched` processes that died."""
        import triton_python_backend_utils as pb_utils

        death = cls._death(model, watched)
        if death is not None:
            raise StepError(death, getattr(pb_utils.TritonError, "UNAVAILABLE", None))

    @staticmethod
    def _death(model, watched):
        """What to tell of the first of the `watched` processes that died, or None. One of a
        version while another version of the model has processes has not died: a reload
        replaced its version and unloaded it (Triton loads the new version first, and sends no
        request to the old one while one runs there). Read from /proc, not asked of Triton: a
        stopping server (SIGTERM, as serve sends on a death it saw first) answers no readiness
        (core's ModelIsReady: "Server not ready"), and a second concurrent is_model_ready then
        never returns (measured on 2.51). The tensorrt_llm model's own error names how its
        process died (the signal): _watched waits GRACE_S for it before telling this."""
        for pid in dead(watched):
            instance, what, version = watched[pid]
            if {v for _, _, v in model_processes(model).values()} - {version}:
                del watched[pid]
                continue
            return (
                f"model process {instance} ({what}, pid {pid}) died: this request was cut "
                "off; send it again"
            )
        return None

    @staticmethod
    def _stop(model, request_id, responses, decoupled):
        """Stop the model's request `request_id`: the stop request of the tensorrtllm backend
        (upstream's BLS sends the same), and Triton's own cancellation where the Python backend
        has it (24.12 and later; not 2.51's). The stopped request's responses are read to
        their end by _watched's reader: the Python backend's response iterator waits for a
        stream's last response when it is freed, and one freed mid-stream holds this model's
        unload (SIGTERM) forever."""
        import triton_python_backend_utils as pb_utils

        cancel = getattr(responses, "cancel", None)
        if cancel is not None:
            cancel()
        stop = pb_utils.InferenceRequest(
            model_name=model,
            request_id=request_id,
            inputs=[
                pb_utils.Tensor("input_ids", np.zeros((1, 1), np.int32)),
                pb_utils.Tensor("input_lengths", np.zeros((1, 1), np.int32)),
                pb_utils.Tensor("request_output_len", np.zeros((1, 1), np.int32)),
                pb_utils.Tensor("stop", np.array([[True]])),
            ],
            requested_output_names=[],
        )
        answer = stop.exec(decoupled=decoupled)  # its one empty response
        for _ in answer if decoupled else ():
            pass

    @staticmethod
    def _step(request, model, inputs, outputs, tensors, request_id=""):
        import triton_python_backend_utils as pb_utils

        given = []
        for name, tensor in inputs.items():
            if tensor in tensors:
                given.append(pb_utils.Tensor(name, tensors[tensor]))
                continue
            value = pb_utils.get_input_tensor_by_name(request, tensor)
            if value is not None:  # an optional input the client left out stays out
                given.append(pb_utils.Tensor(name, value.as_numpy()))
        return pb_utils.InferenceRequest(
            model_name=model, inputs=given, requested_output_names=list(outputs),
            request_id=request_id,
        )  # fmt: skip

    @staticmethod
    def _check(response):

        if response.has_error():
            error = response.error()
            raise StepError(error.message(), getattr(error, "code", lambda: None)())

    @staticmethod
    def _gather(response, outputs, tensors):
        import triton_python_backend_utils as pb_utils

        for name, tensor in outputs.items():
            value = pb_utils.get_output_tensor_by_name(response, name)
            if value is not None:
                tensors[tensor] = value.as_numpy()

    @staticmethod
    def _text(text):
        import triton_python_backend_utils as pb_utils

        out = np.array([[text.encode("utf-8")]], dtype=object)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", out)])
