"""Config settings arrive in the components `hacpo.engine.build` makes from them: each agent's
optimizer settings in its own optimizer, the KL coefficient deciding the reference copies."""
import torch

from hacpo.engine.build import build_optimizers, reference_policies
from hacpo.engine.run_config import load_config


def _cfg(**over):
    return load_config("tiny3", overrides={k.replace("__", "."): v for k, v in over.items()})


def test_each_agents_optim_settings_reach_its_optimizer():
    cfg = _cfg(agents__0__optim__lr=2e-3, agents__0__optim__beta1=0.8,
               agents__0__optim__beta2=0.95, agents__0__optim__weight_decay=0.1,
               agents__1__optim__lr=7e-4, agents__1__optim__beta1=0.5,
               agents__1__optim__beta2=0.75)
    mods = [torch.nn.Linear(2, 2) for _ in cfg.agents]
    opts = build_optimizers(cfg, mods)
    want = [(2e-3, (0.8, 0.95), 0.1), (7e-4, (0.5, 0.75), 0.0), (1e-3, (0.9, 0.99), 0.0)]
    for opt, mod, (lr, betas, wd) in zip(opts, mods, want, strict=True):
        (g,) = opt.param_groups
        assert (g["lr"], tuple(g["betas"]), g["weight_decay"]) == (lr, betas, wd)
        assert [id(p) for p in g["params"]] == [id(p) for p in mod.parameters()]


def test_reference_policies_only_with_a_kl_term():
    mods = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    assert reference_policies(_cfg(), mods) == [None, None]          # kl_coef 0: no copies
    refs = reference_policies(_cfg(algorithm__loss__kl_coef=0.01), mods)
    for r, m in zip(refs, mods, strict=True):
        assert r is not m and not r.training
        assert not any(p.requires_grad for p in r.parameters())
        assert torch.equal(r.weight, m.weight) and m.weight.requires_grad
