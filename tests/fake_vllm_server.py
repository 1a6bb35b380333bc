"""A stand-in for a vLLM server that speaks the HTTP the ``vllm_server`` engine uses, so the
fast tier tests the client without vLLM: ``/health``, ``/inference/v1/generate`` (token ids
in; token ids, behaviour log-probs, finish reason and weight-version spans out;
``prompt_logprobs`` for the guard), and the RL API's weight push (``/pause``,
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` with
posttrain's safetensors buckets, ``/finish_weight_update``, ``/reset_prefix_cache``,
``/resume``), and vLLM's LoRA routes (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``, ``/update_weight_version``; a request's ``model`` names the
adapter). It samples with posttrain's ``hf`` engine on a model of its own, a sample
seeded by the request's seed alone, so which server draws a sample does not change it.

Knobs for the tests: ``stall`` (an event: while set, generate calls hang as a SIGSTOPped
server's would), ``dead`` (every connection closed unanswered, as a killed server's;
``die_after`` sets it after that many pushes), ``ignore_pushes`` (a push that loads
nothing: a broken transport), ``version`` (overwrite the version it reports: a
server restarted on other weights).

``transfer="nccl"`` stands in for vLLM's ``nccl`` weight transfer engine: ``/get_world_size``
answers 1, ``/init_weight_transfer_engine`` joins the group the trainer opened on the
port it names (a :class:`FakeGroup`, which ``posttrain.rollout.nccl_push.open_group`` is
patched to make: tensors broadcast go through a queue in order), and ``/update_weights``
takes the names, dtypes and shapes it lists from that queue and loads them, as vLLM's
unpacked receive does. ``hold_buckets`` (an event: while set, it takes nothing) stands in
for a server that never takes its bucket."""

from __future__ import annotations

import base64
import copy
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load, load_file

from posttrain.rollout import Request, SamplingParams
from posttrain.rollout.hf import HFEngine

_GROUPS: dict[int, FakeGroup] = {}
"""The groups trainers opened, by port (a server joins the one its init names)."""
_OPENED = threading.Condition()


class FakeGroup:
    """The trainer's end of a fake NCCL group: what it broadcasts, the server takes in order;
    ``done`` once it has taken everything broadcast so far."""

    def __init__(self, address: str, world: int, listener, timeout: float, device: int):
        assert world == 2 and address == "127.0.0.1", (address, world)
        self.tensors: queue.Queue = queue.Queue()
        self.aborted = False
        self.listener = listener  # (its port names the group; held while it is open)
        with _OPENED:
            _GROUPS[listener.getsockname()[1]] = self
            _OPENED.notify_all()

    def stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in tensors]

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.tensors.put(tensor)

    def done(self) -> bool:
        return self.tensors.unfinished_tasks == 0

    def abort(self) -> None:
        self.aborted = True
        self.listener.close()


def _join(port: int, timeout: float = 30.0) -> FakeGroup:
    with _OPENED:
        if not _OPENED.wait_for(lambda: port in _GROUPS, timeout):
            raise TimeoutError(f"no group opened on port {port}")
        return _GROUPS.pop(port)


class FakeServer:
    def __init__(self, model, tokenizer, key: str | None = None, transfer: str = "posttrain"):
        self.model = copy.deepcopy(model).eval()
        self.transfer = transfer
        self.group: FakeGroup | None = None
        self.updating = False  # (between a start and a finish of a weight update)
        self.hold_buckets = threading.Event()
        self.tokenizer, self.key = tokenizer, key
        self.version = "default"
        self.stall = threading.Event()
        self.released = threading.Event()  # (never set: stall's poll interval)
        self.ignore_pushes = False
        self.dead = False  # closes every connection unanswered, as a killed server's drops
        self.die_after: int | None = None  # pushes after which it is dead (None: never)
        self.pushes = 0
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self.engine = HFEngine(self.model, tokenizer, shares_weights=True)
        self.adapters: dict[str, tuple] = {}
        """Loaded LoRA adapters: name -> (the adapted model, its engine)."""
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if fake.dead:
                    self.close_connection = True
                    return
                self._reply(*fake.handle("GET", self.path, None, self.headers))

            def do_POST(self):
                if fake.dead:  # no answer: the client sees the connection dropped
                    self.close_connection = True
                    return
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                self._reply(*fake.handle("POST", self.path, body, self.headers))

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # (a run sends hundreds of requests at once)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, method: str, path: str, body, headers) -> tuple[int, dict]:
        route = path.split("?")[0]
        self.calls.append(route)
        if route.startswith("/inference") and self.key and \
                headers.get("Authorization") != f"Bearer {self.key}":
            return 401, {"error": "Unauthorized"}
        if route in ("/health", "/is_paused"):
            while self.stall.is_set():  # (a stopped process answers nothing)
                self.released.wait(0.05)
            return 200, {"is_paused": False} if route == "/is_paused" else {}
        if route == "/inference/v1/generate":
            if body.get("model") and body["model"] not in self.adapters:
                return 404, {"error": f"The model `{body['model']}` does not exist."}
            while self.stall.is_set():  # hung, as a stopped process is, until released
                self.released.wait(0.05)
            return 200, self.generate(body)
        if route == "/get_world_size":
            return 200, {"world_size": 1}
        if self.transfer == "nccl" and route == "/init_weight_transfer_engine":
            info = body["init_info"]
            assert info["rank_offset"] == 1 and info["packed"] is False, info
            self.group = _join(info["master_port"])
            return 200, {}
        if self.transfer == "nccl" and route == "/update_weights":
            return self.receive(body["update_info"])
        if route in ("/init_weight_transfer_engine", "/update_weights"):
            info = body.get("init_info") or body.get("update_info")
            if self.key and info.get("key") != self.key:
                return 500, {"error": "weight push refused"}
            if route == "/update_weights" and not self.ignore_pushes:
                blob = (load(base64.b64decode(info["data"])) if info.get("data") is not None
                        else load_file(info["path"]))
                with self.lock, torch.no_grad():
                    params = dict(self.model.named_parameters(remove_duplicate=False))
                    for name, t in blob.items():
                        params[name].copy_(t)
            return 200, {}
        if route == "/start_weight_update":  # (vLLM's worker: one update at a time)
            if self.updating:
                return 500, {"error": "start_weight_update called while a weight update "
                                      "is already active"}
            self.updating = True
            return 200, {}
        if route == "/finish_weight_update":
            if not self.updating:
                return 500, {"error": "finish_weight_update called without a matching "
                                      "start_weight_update"}
            self.updating = False
            self.version = (body or {}).get("weight_version", self.version)
            self.pushes += 1
            if self.die_after is not None and self.pushes >= self.die_after:
                self.dead = True
            return 200, {}
        if route == "/v1/load_lora_adapter":
            if body["lora_name"] in self.adapters:
                return 400, {"error": f"{body['lora_name']} is loaded already"}
            from peft import PeftModel

            with self.lock:
                if self.ignore_pushes and self.adapters:  # (the name, the old adapter)
                    self.adapters[body["lora_name"]] = next(iter(self.adapters.values()))
                    return 200, {}
                adapted = PeftModel.from_pretrained(copy.deepcopy(self.model),
                                                    body["lora_path"]).eval()
                self.adapters[body["lora_name"]] = (adapted, HFEngine(
                    adapted, self.tokenizer, shares_weights=True))
            return 200, {}
        if route == "/v1/unload_lora_adapter":
            return (200, {}) if self.adapters.pop(body["lora_name"], None) else (
                404, {"error": f"no adapter {body['lora_name']}"})
        if route == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {}
        if route in ("/pause", "/resume", "/reset_prefix_cache",
                     "/shutdown_weight_transfer_engine"):
            return 200, {}
        return 404, {"error": f"no route {route}"}

    def receive(self, info: dict) -> tuple[int, dict]:
        """vLLM's unpacked NCCL receive: each listed tensor, in order, from the group."""
        while self.hold_buckets.is_set():
            time.sleep(0.05)
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"],
                                      strict=True):
            if self.group is None or self.group.aborted:
                return 500, {"error": "NCCL weight transfer not initialized"}
            t = self.group.tensors.get(timeout=30.0)
            assert t.dtype == getattr(torch, dtype) and list(t.shape) == shape, (name, t.shape)
            if not self.ignore_pushes:
                with self.lock, torch.no_grad():
                    params[name].copy_(t)
            self.group.tensors.task_done()
        return 200, {}

    def generate(self, body: dict) -> dict:
        ids, sp = body["token_ids"], body["sampling_params"]
        model, engine = self.adapters[body["model"]] if body.get("model") else (self.model,
                                                                               self.engine)
        if sp.get("prompt_logprobs") is not None:
            with self.lock, torch.no_grad():
                z = model(input_ids=torch.tensor([ids])).logits[0].float()
            lp = z.log_softmax(-1)
            rows = [None] + [{str(ids[t]): {"logprob": float(lp[t - 1, ids[t]])}}
                             for t in range(1, len(ids))]
            return {"prompt_logprobs": rows, "choices": [{"index": 0, "token_ids": [],
                                                          "finish_reason": "length"}]}
        params = SamplingParams(temperature=sp["temperature"], top_p=sp["top_p"],
                                top_k=max(sp["top_k"], 0), max_new_tokens=sp["max_tokens"],
                                stop=tuple(sp.get("stop") or ()))
        with self.lock:
            ro = engine.generate([Request(tuple(ids), sp["seed"])], 1, params)
        n = int(ro.completion_mask[0].sum())
        out = ro.completion_ids[0, :n].tolist()
        lps = ro.logprobs[0, :n].tolist()
        content = [{"token_id": t, "logprob": x} for t, x in zip(out, lps, strict=True)]
        return {"choices": [{
            "index": 0, "token_ids": out,
            "finish_reason": "length" if bool(ro.truncated[0]) else "stop",
            "logprobs": {"content": content},
            "weight_versions": [{"version": self.version, "start": 0, "end": n}] if n else []}]}

    def close(self) -> None:
        self.stall.clear()
        self.hold_buckets.clear()
        self.httpd.shutdown()
        self.httpd.server_close()
