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
server restarted on other weights)."""

from __future__ import annotations

import base64
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from safetensors.torch import load, load_file

from posttrain.rollout import Request, SamplingParams
from posttrain.rollout.hf import HFEngine


class FakeServer:
    def __init__(self, model, tokenizer, key: str | None = None):
        self.model = copy.deepcopy(model).eval()
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
        if route == "/health":
            return 200, {}
        if route == "/inference/v1/generate":
            if body.get("model") and body["model"] not in self.adapters:
                return 404, {"error": f"The model `{body['model']}` does not exist."}
            while self.stall.is_set():  # hung, as a stopped process is, until released
                self.released.wait(0.05)
            return 200, self.generate(body)
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
        if route == "/finish_weight_update":
            self.version = body["weight_version"]
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
        if route in ("/pause", "/resume", "/start_weight_update", "/reset_prefix_cache"):
            return 200, {}
        return 404, {"error": f"no route {route}"}

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
        self.httpd.shutdown()
        self.httpd.server_close()
