"""Everything a run needs before step 0: data, tokenizers, policies (warm-started), optimizers."""
from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, asdict

import torch

from hacpo.models.policy import Policy, build_policy

from . import checkpoint as ckpt
from .data import Example, GSM8K_FIELDS, MATH_ANSWER_FIELDS, MATH_FIELDS, \
    apply_prompt_template, load_examples
from .run_config import TrainConfig, config_hash
from .tasks import ArithmeticTask, reference_solution
from .warmup import supervised_warmup

log = logging.getLogger("hacpo")
_FIELD_MAPS = {"gsm8k": GSM8K_FIELDS, "math": MATH_FIELDS, "math_answer": MATH_ANSWER_FIELDS}


@dataclass
class Data:
    train: list[Example]
    eval: list[Example]
    worked: bool            # train targets are worked solutions (embedded task)
    load_stats: dict

    def target_text(self, ex: Example) -> str:
        return reference_solution(ex) if self.worked else f"#### {ex.answer}"


def load_data(cfg: TrainConfig) -> Data:
    d = cfg.data
    if d.task == "arithmetic":
        task = ArithmeticTask.from_difficulty(d.difficulty, wording=d.wording, seed=d.seed)
        return Data(task.train_split(d.train_size), task.heldout_split(d.eval_size), True, {})
    fm = _FIELD_MAPS.get(d.field_map, d.field_map)
    if isinstance(fm, str) and fm != "auto":
        raise ValueError(f"unknown data.field_map {d.field_map!r}; one of auto, "
                         f"{', '.join(_FIELD_MAPS)}")
    train, st = load_examples(d.train_path, fm, skip_bad_rows=d.skip_bad_rows)
    ev, se = load_examples(d.eval_path, fm, skip_bad_rows=d.skip_bad_rows, limit=d.eval_size)
    return Data(train, ev, False, {"train": asdict(st), "eval": asdict(se)})


def prompt_text(cfg: TrainConfig, ex: Example) -> str:
    return apply_prompt_template(cfg.data.template, ex.prompt)


def corpus(cfg: TrainConfig, data: Data) -> list[str]:
    """Texts a reduced vocabulary must cover: prompts (templated) and target answers."""
    texts = [prompt_text(cfg, e) for e in data.train + data.eval]
    return texts + [data.target_text(e) for e in data.train[:5000]]


def build_policies(cfg: TrainConfig, data: Data) -> list[Policy]:
    texts = None
    policies = []
    for a in cfg.agents:
        if a.policy.reduce_vocab and texts is None:
            texts = corpus(cfg, data)
        policies.append(build_policy(a.policy, corpus=texts if a.policy.reduce_vocab else None))
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    return policies


def warm_start(cfg: TrainConfig, data: Data, policies: list[Policy], echo=print) -> list[dict]:
    """Supervised warm-up per agent, cached in cfg.cache_dir by a hash of everything that
    determines its result. It does not depend on the RL seed or algorithm, so every run of
    `hacpo compare` shares it."""
    out = []
    for k, (a, pol) in enumerate(zip(cfg.agents, policies)):
        if a.warmup.steps <= 0:
            out.append({"steps": 0})
            continue
        key = config_hash({"policy": asdict(a.policy), "warmup": asdict(a.warmup),
                           "data": asdict(cfg.data), "v": 1})
        path = os.path.join(cfg.cache_dir, f"warmup-{a.policy.name}-{key}.pt")
        if os.path.exists(path):
            state = ckpt.load(path)
            pol.load_state_dict(state["model"])
            echo(f"[warm-up] {a.policy.name}: loaded cached warm start {path}")
            out.append({"steps": a.warmup.steps, "cached": True,
                        "final_loss": state["losses"][-1]})
            continue
        tok = pol.tokenizer
        prompts = [tok.prompt_ids(prompt_text(cfg, e)) for e in data.train]
        targets = [tok.response_ids(data.target_text(e), add_eos=True) for e in data.train]
        every = max(1, a.warmup.steps // 5)

        def progress(step, loss, name=a.policy.name, total=a.warmup.steps):
            if step % every == 0 or step == total - 1:
                echo(f"[warm-up] {name}: step {step + 1}/{total} loss {loss:.3f}")

        losses = supervised_warmup(pol, prompts, targets, steps=a.warmup.steps, lr=a.warmup.lr,
                                   batch_size=a.warmup.batch_size, seed=a.policy.seed + 101 * k,
                                   micro_batch=cfg.micro_batch, progress=progress)
        ckpt.save_atomic({"model": pol.state_dict(), "losses": losses}, path)
        out.append({"steps": a.warmup.steps, "cached": False, "final_loss": losses[-1]})
    return out


def rollout_engine(cfg: TrainConfig, policies: list[Policy], agents=None):
    """The configured ``RolloutEngine`` (rollout.engine). Remote engines are imported lazily:
    the local path never imports ray or vllm. ``agents``: the run's trainer agents
    (``rollout.colocate`` places each vLLM engine in its agent's trainer bundles)."""
    kind = cfg.rollout.engine
    if kind == "local":
        from .rollout import LocalRolloutEngine
        return LocalRolloutEngine(policies, cfg.seed)
    if kind == "ray":
        from hacpo.launch.ray_rollout import RayRolloutEngine
        return RayRolloutEngine(policies, cfg)
    if kind == "vllm":
        from hacpo.launch.vllm_rollout import VLLMRolloutEngine
        placement = None
        if cfg.rollout.colocate:
            placement = [agents.engine_bundles(k) for k in range(len(policies))]
        return VLLMRolloutEngine(policies, cfg, placement=placement)
    raise ValueError(f"unknown rollout.engine {kind!r}")


def build_optimizers(cfg: TrainConfig, policies: list[Policy]):
    return [torch.optim.AdamW(p.parameters(), lr=a.optim.lr, betas=(a.optim.beta1, a.optim.beta2),
                              weight_decay=a.optim.weight_decay)
            for a, p in zip(cfg.agents, policies)]


def reference_policies(cfg: TrainConfig, policies: list[Policy]):
    """Frozen copies for the optional KL term (only when loss.kl_coef > 0)."""
    if cfg.algorithm.loss.kl_coef <= 0:
        return [None] * len(policies)
    refs = [copy.deepcopy(p).eval() for p in policies]
    for r in refs:
        r.requires_grad_(False)
    return refs
