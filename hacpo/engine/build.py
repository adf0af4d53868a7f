"""Everything a run needs before step 0: data, tokenizers, policies (warm-started), optimizers."""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, asdict

import torch

from hacpo.models.policy import Policy, build_policy
from hacpo.models.tokenizer import KNOWN_TOKENIZERS, Tokenizer, batches, load_tokenizer

from . import checkpoint as ckpt
from .data import FIELD_MAPS, DataError, Example, LoadStats, apply_prompt_template, \
    load_examples
from .errors import describe_os_error
from .run_config import TrainConfig, config_hash, expand_user
from .tasks import ArithmeticTask, reference_solution
from .warmup import supervised_warmup

log = logging.getLogger("hacpo")


@dataclass
class Data:
    train: list[Example]
    eval: list[Example]
    worked: bool            # train targets are worked solutions (embedded task)
    load_stats: dict

    def target_text(self, ex: Example) -> str:
        return reference_solution(ex) if self.worked else f"#### {ex.answer}"


def load_data(cfg: TrainConfig) -> Data:
    """The run's training and held-out examples.

    data.task="arithmetic": ``train_size`` and ``eval_size`` problems of the embedded task
    (DataConfig checks train_size >= 1, eval_size >= 0); ``load_stats`` is ``{}``.
    data.task="files": every example of ``train_path`` and the first ``eval_size`` of
    ``eval_path``; ``eval_size=0`` means no held-out set (``eval`` is ``[]``, the eval file is
    not read and its stats are zeros). A file that yields no examples (no rows, or every row
    bad and skipped) is a DataError naming it. ``load_stats`` is ``{"train": S, "eval": S,
    "eval_in_train": n}``, ``S = {"path", "rows", "loaded", "skipped", "problems",
    "bad_rows"}`` (the path and :class:`~hacpo.engine.data.LoadStats`), ``n`` the held-out
    problems the training file holds too (:func:`_check_held_out`); each file read is logged,
    as a warning where rows were skipped."""
    d = cfg.data
    if d.task == "arithmetic":
        task = ArithmeticTask.from_difficulty(d.difficulty, wording=d.wording, seed=d.seed)
        return Data(task.train_split(d.train_size), task.heldout_split(d.eval_size), True, {})
    fm = FIELD_MAPS.get(d.field_map, d.field_map)
    if isinstance(fm, str) and fm != "auto":
        raise ValueError(f"unknown data.field_map {d.field_map!r}; one of auto, "
                         f"{', '.join(FIELD_MAPS)}")
    train, st = _read_examples("train", d.train_path, fm, skip_bad_rows=d.skip_bad_rows)
    _check_loaded("train", d.train_path, d.field_map, st)
    if d.eval_size == 0:
        ev, se = [], LoadStats()
    else:
        ev, se = _read_examples("eval", d.eval_path, fm, skip_bad_rows=d.skip_bad_rows,
                                limit=d.eval_size)
        _check_loaded("eval", d.eval_path, d.field_map, se)
    return Data(train, ev, False, {"train": {"path": d.train_path, **asdict(st)},
                                   "eval": {"path": d.eval_path, **asdict(se)},
                                   "eval_in_train": _check_held_out(cfg, train, ev)})


def _question(text: str) -> str:
    return " ".join(text.split()).casefold()


def _check_held_out(cfg: TrainConfig, train: list[Example], ev: list[Example]) -> int:
    """How many held-out problems the training file holds too (the same question, up to
    whitespace and case): warned, since their accuracy is not held out (the same file for
    both, or an eval file drawn from the training data). Not refused: a user may mean it."""
    if not ev:
        return 0
    seen = {_question(e.prompt) for e in train}
    both = sum(_question(e.prompt) in seen for e in ev)
    if both:
        d = cfg.data
        same = os.path.realpath(d.train_path) == os.path.realpath(d.eval_path)
        log.warning(f"data.eval_path {d.eval_path}: {both} of its {len(ev)} held-out problems "
                    f"are in data.train_path {d.train_path} too"
                    + (" (the same file)" if same else " (the same question)")
                    + ": their accuracy after RL is not held out")
    return both


def _read_examples(role: str, path: str, fm, **kw):
    """load_examples of data.<role>_path; a path that cannot be read (missing, a directory,
    no permission, an I/O error) is a DataError naming the key, the path and the cause."""
    if os.path.isdir(path):      # pyarrow would read a directory named *.parquet as a dataset
        raise DataError(f"data.{role}_path {path}: is a directory, not a .jsonl or .parquet "
                        f"file")
    try:
        return load_examples(path, fm, **kw)
    except OSError as e:
        raise DataError(f"data.{role}_path {path}: cannot be read: "
                        f"{describe_os_error(e)}") from None


def _check_loaded(role: str, path: str, field_map: str, st: LoadStats) -> None:
    """Log what data.<role>_path yielded (a warning if rows were skipped); DataError if it
    yielded no examples."""
    where = f"data.{role}_path {path}"
    if st.skipped:
        at = ", ".join(st.bad_rows[:5]) + (", ..." if st.skipped > 5 else "")
        log.warning(f"{where}: {st.loaded} examples from {st.rows} rows; skipped {st.skipped} "
                    f"bad rows (data.skip_bad_rows) at {at}; first: {st.problems[0]}")
    else:
        log.info(f"{where}: {st.loaded} examples from {st.rows} rows")
    if st.loaded:
        return
    fm = FIELD_MAPS.get(field_map)
    fields = "auto (detected from the first good row)" if fm is None else \
        f"{field_map} (prompt {fm.prompt!r}, answer {fm.answer!r}, format {fm.answer_format})"
    if st.rows == 0:
        why = "the file has no rows (empty, or blank lines only)"
    else:
        shown = "; ".join(st.problems[:3])
        why = (f"all {st.rows} non-blank rows were bad and skipped (data.skip_bad_rows), "
               f"field map {fields}; first: {shown}")
    raise DataError(f"{where} yields no examples: {why}")


def prompt_text(cfg: TrainConfig, ex: Example) -> str:
    return apply_prompt_template(cfg.data.template, ex.prompt)


def corpus(cfg: TrainConfig, data: Data) -> list[str]:
    """Texts a reduced vocabulary must cover: prompts (templated) and the target answers of
    every training example (the warm-up encodes them all: a byte-level BPE merges digits into
    tokens that a subset of them may never produce)."""
    texts = [prompt_text(cfg, e) for e in data.train + data.eval]
    return texts + [data.target_text(e) for e in data.train]


def keeps_torch_threads(fn):
    """Decorator: ``fn`` (a run, an evaluation, an export) may set torch's thread count for
    its work (``threads``: build_policies); the caller's count is restored after it, so a
    second run in the same process (the Python API, a notebook) starts from its own."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)
    return wrapper


def build_policies(cfg: TrainConfig, data: Data | None,
                   names: Collection[str] | None = None,
                   tokenizers: Mapping[str, Tokenizer] | None = None) -> list[Policy]:
    """The run's policies in config order; ``names``: those agents' only (`hacpo eval` /
    `export --agents`: another agent's missing model or tokenizer files do not stop them).
    ``tokenizers``: tokenizers already made, by agent name (:func:`rebuild_policies`: reduced
    vocabularies a checkpoint records); the others' vocabularies are reduced to ``data``
    (None where none is)."""
    tokenizers = tokenizers or {}
    texts = prompts = None
    policies = []
    for a in cfg.agents:
        name = a.policy.name
        if names is not None and name not in names:
            continue
        if name in tokenizers:
            policies.append(build_policy(a.policy, tokenizer=tokenizers[name]))
            continue
        if a.policy.reduce_vocab and texts is None:
            texts = corpus(cfg, data)
            prompts = [prompt_text(cfg, e) for e in data.train + data.eval]  # as prompt_ids
        policies.append(build_policy(a.policy, corpus=texts if a.policy.reduce_vocab else None,
                                     prompts=prompts if a.policy.reduce_vocab else None))
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    return policies


def tokenizer_record(policies: list[Policy]) -> dict[str, list]:
    """What a training checkpoint records of each policy's tokenizer: ``tokenizers``, a digest
    of what its ids mean (a run resumed, evaluated or exported with another is refused:
    :func:`tokenizer_mismatch`), ``encodings``, a digest of how it turns text into prompt ids
    (a run resumed with another is refused: :func:`encoding_mismatch`), and ``vocabs``, by
    agent name, each reduced vocabulary (its kept original ids, int64), from which `hacpo
    eval` / `export` rebuild it without reading the data."""
    vocabs = {}
    for p in policies:
        if (kept := p.tokenizer.kept_ids()) is not None:
            vocabs[p.name] = torch.tensor(kept, dtype=torch.int64)
    return {"tokenizers": [tokenizer_digest(p.tokenizer) for p in policies],
            "encodings": encoding_digests(policies),
            "vocabs": vocabs}


def encoding_digests(policies: list[Policy]) -> list[str]:
    """A hash of each policy's tokenizer's ``encoding_probe()`` (how it renders and encodes
    fixed texts: milliseconds), for the checkpoint and the resume check: by what
    the tokenizer does, so that a tokenizers upgrade that writes tokenizer.json otherwise and
    encodes alike does not refuse a resume (the warm-start cache keys on the stricter
    :func:`encoding_digest`, where a miss costs a warm-up only)."""
    return [_digest(p.tokenizer.encoding_probe()) for p in policies]


def saved_vocabs(state: dict) -> dict[str, list[int]]:
    """The reduced vocabularies a training checkpoint records, by agent name (one written
    before it recorded them has none: its agents' are reduced to the data again)."""
    vocabs = state.get("vocabs")
    if not isinstance(vocabs, dict):
        return {}
    return {n: v.tolist() for n, v in vocabs.items() if isinstance(v, torch.Tensor)}


def rebuild_policies(cfg: TrainConfig, state: dict, names: Collection[str],
                     where: str) -> list[Policy]:
    """Agents ``names`` of training checkpoint ``state`` (of ``cfg``; ``where``: e.g. "cannot
    evaluate <path>", for errors), rebuilt (not yet loaded): a reduced vocabulary from the
    checkpoint's record of it; the run's data is read only for one that has none (a
    checkpoint written before it recorded them)."""
    vocabs, made = saved_vocabs(state), {}
    for a in cfg.agents:
        if (name := a.policy.name) in vocabs and name in names and a.policy.reduce_vocab:
            try:
                made[name] = load_tokenizer(a.policy.tokenizer, kept=vocabs[name])
            except ValueError as e:
                raise ValueError(f"{where}: agent {name}'s reduced vocabulary recorded there "
                                 f"does not fit its tokenizer: {e}") from None
    for i, a in enumerate(cfg.agents):     # a folder moved since the run: say how to name it
        for key in MOVABLE:
            spec = getattr(a.policy, key)
            if a.policy.name in names and is_folder(key, spec, a.policy.kind) \
                    and not os.path.exists(spec):
                raise FileNotFoundError(
                    f"{where}: agent {a.policy.name}'s policy.{key} {spec} does not exist "
                    f"(moved? --set agents.{i}.policy.{key}=NEW names its new place)")
    reduced_here = any(a.policy.reduce_vocab and a.policy.name not in made
                       for a in cfg.agents if a.policy.name in names)
    data = load_data(cfg) if reduced_here else None
    return build_policies(cfg, data, names=set(names), tokenizers=made)


# An agent's folders that may move (run and models copied to another machine or mount):
# agents.N.policy.<key>=NEW names the new place (a resume, `hacpo eval`, `hacpo export`), and
# what it holds is checked against the checkpoint's record of it (check_moved)
MOVABLE = ("path", "tokenizer")
_MOVED_KEY = re.compile(r"^agents\.(\d+)\.policy\.(path|tokenizer)$")


def is_folder(key: str, spec, kind: str = "hf") -> bool:
    """Whether policy.<key> ``spec`` names a folder (or file) of the run's (not a tokenizer
    known by name, not an unset path; a decoder reads no policy.path)."""
    if not isinstance(spec, str) or not spec:
        return False
    return kind == "hf" if key == "path" else spec != "char" and spec not in KNOWN_TOKENIZERS


def model_record(cfg: TrainConfig) -> dict[str, dict[str, str]]:
    """What a training checkpoint records of each policy.path model folder, by agent name:
    a digest of its config.json (the architecture the checkpoint's weights are read into), so
    a folder named at another place is checked to hold the same model (check_moved)."""
    return {"model_configs": {a.policy.name: model_config_digest(a.policy.path)
                              for a in cfg.agents if is_folder("path", a.policy.path,
                                                               a.policy.kind)}}


def model_config_digest(path: str) -> str:
    """Hash of a model folder's config.json, less what says where and with which transformers
    version it was saved (a copied folder, or one saved again, is the same model)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        d = json.load(f)
    if isinstance(d, dict):
        d.pop("_name_or_path", None), d.pop("transformers_version", None)
    return _digest(d)


def check_moved(state: dict, index: int, name, key: str, old: str, new: str) -> None:
    """ValueError unless folder ``new``, named for agent ``index``'s (``name``) policy.<key>
    instead of the run's ``old``, can stand for it: the checkpoint records what the run's
    held (a model folder's config.json, checked here; a tokenizer's vocabulary, checked once
    it is built: tokenizer_mismatch)."""
    where = f"agents.{index}.policy.{key}={new}"
    if not os.path.exists(new):
        raise ValueError(f"{where}: no such file or folder")
    want = (state.get("model_configs") or {}).get(name) if key == "path" else \
        state.get("tokenizers")
    if not want:
        raise ValueError(f"{where}: the checkpoint does not record what the run's folder "
                         f"{old} held (written before hacpo recorded it): put the folder back "
                         f"there, or link it")
    if key == "path":
        try:
            got = model_config_digest(new)
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: cannot read its config.json: {e}") from None
        if got != want:
            raise ValueError(f"{where}: another model than the run's ({old}): its config.json "
                             f"differs")


def moved_config(state: dict, moved: Mapping[str, str], where: str) -> dict:
    """A copy of training checkpoint ``state``'s config with the folders ``moved`` names
    (``{"agents.N.policy.path" | "agents.N.policy.tokenizer": new place}``) there, each
    checked (check_moved). ValueError on any other key, an agent the run does not have, or a
    key that names no folder of the run's."""
    stored = copy.deepcopy(state["config"])
    agents = stored.get("agents") if isinstance(stored, dict) else None
    for k, new in moved.items():
        m = _MOVED_KEY.match(k)
        if m is None:
            raise ValueError(f"--set {k}: only agents.N.policy.path / agents.N.policy.tokenizer "
                             f"(a model or tokenizer folder moved since the run) apply here")
        i, key = int(m.group(1)), m.group(2)
        if not isinstance(agents, list) or i >= len(agents):
            raise ValueError(f"--set {k}: {where} has {len(agents or [])} agents (agents.0 "
                             f"to agents.{len(agents or []) - 1})")
        pol = agents[i].get("policy") if isinstance(agents[i], dict) else None
        old = pol.get(key) if isinstance(pol, dict) else None
        if not is_folder(key, old, pol.get("kind", "decoder") if pol else "decoder"):
            raise ValueError(f"--set {k}: agent {i} of {where} reads no folder there "
                             f"(policy.{key}={old!r})")
        new = os.path.abspath(expand_user(new))
        check_moved(state, i, pol.get("name"), key, old, new)
        pol[key] = new
    return stored


def warm_start(cfg: TrainConfig, data: Data, policies: list[Policy], echo=print) -> list[dict]:
    """Supervised warm-up per agent, cached in cfg.cache_dir by a hash of everything that
    determines its result: the policy's config and initial weights, its tokenizer's vocabulary
    (a reduced one depends on the data) and encoding, the warm-up config and batch seed, and
    the prompt and target texts it trains on (their content, not the files' paths; with the
    tokenizer, the token ids). It does not depend on the RL seed or algorithm, so every run of
    `hacpo compare` shares it. A cached state that cannot be read or does not fit the policy is
    a logged miss: trained again."""
    out = []
    examples_digest = None
    for k, (a, pol) in enumerate(zip(cfg.agents, policies)):
        if a.warmup.steps <= 0:
            out.append({"steps": 0})
            continue
        if examples_digest is None:     # the texts trained on (with the tokenizer: the ids)
            examples_digest = _texts_digest((prompt_text(cfg, e), data.target_text(e))
                                            for e in data.train)
        tok = pol.tokenizer
        seed = a.policy.seed + 101 * k
        keyed = {"policy": asdict(a.policy), "warmup": asdict(a.warmup), "seed": seed,
                 "init": _state_digest(pol), "tokenizer": tokenizer_digest(tok),
                 "encoding": encoding_digest(tok), "examples": examples_digest,
                 # 4: bf16 / fp16 warm-ups step fp32 master weights; 5: their grad
                 # norm and clip in fp32 (fp32 warm-ups: unchanged, bit for bit)
                 "v": 3 if a.policy.dtype == "float32" else 5}
        if cfg.micro_batch < a.warmup.batch_size:
            # a batch cut into micro-batches sums its gradient in another order: other bits
            # (a batch in one piece, whatever micro_batch, keeps the key it always had)
            keyed["micro_batch"] = cfg.micro_batch
        key = config_hash(keyed)
        path = os.path.join(cfg.cache_dir, f"warmup-{a.policy.name}-{key}.pt")
        state = _cached_warm_start(path, pol)
        if state is not None:
            # a writer of this file killed mid-save while another run saved it left its temp
            # file (the size of the model), which no later save of this path would remove
            if removed := ckpt.remove_stale_temps(path):
                log.warning(f"[warm-up] removed {len(removed)} temporary file(s) left by a "
                            f"writer of {path} that died mid-save: {', '.join(removed)}")
            pol.load_state_dict(state["model"])
            echo(f"[warm-up] {a.policy.name}: loaded cached warm start {path}")
            out.append({"steps": a.warmup.steps, "cached": True,
                        "final_loss": state["losses"][-1]})
            continue
        prompts = [ids for chunk in batches(data.train)
                   for ids in tok.prompt_ids_batch([prompt_text(cfg, e) for e in chunk])]
        targets = [ids for chunk in batches(data.train)
                   for ids in tok.response_ids_batch([data.target_text(e) for e in chunk],
                                                     add_eos=True)]
        every = max(1, a.warmup.steps // 5)

        def progress(step, loss, name=a.policy.name, total=a.warmup.steps):
            if step % every == 0 or step == total - 1:
                echo(f"[warm-up] {name}: step {step + 1}/{total} loss {loss:.3f}")

        losses = supervised_warmup(pol, prompts, targets, steps=a.warmup.steps, lr=a.warmup.lr,
                                   batch_size=a.warmup.batch_size, seed=seed,
                                   micro_batch=cfg.micro_batch, progress=progress)
        try:
            ckpt.save_atomic({"model": pol.state_dict(), "losses": losses}, path)
        except OSError as e:
            # a cache: the warm start is trained and in the policy; a cache dir that cannot
            # take it (read-only, shared, full) costs the next run this warm-up, not this run
            log.warning(f"[warm-up] {a.policy.name}: warm start not cached ({e}); the run "
                        f"goes on with the warm start it trained")
        out.append({"steps": a.warmup.steps, "cached": False, "final_loss": losses[-1]})
    return out


def _digest(obj, default=None) -> str:
    """Hash of ``obj``'s compact JSON; ``default`` as json.dumps's (``repr``: an object JSON
    cannot hold is hashed as its repr)."""
    return hashlib.sha256(json.dumps(obj, separators=(",", ":"), default=default)
                          .encode()).hexdigest()


def _texts_digest(pairs) -> str:
    """Hash of (prompt, target) text pairs, fed one pair at a time (a large dataset never
    becomes one string)."""
    h = hashlib.sha256()
    for pair in pairs:
        h.update(json.dumps(pair).encode())
        h.update(b"\n")
    return h.hexdigest()


def vocab_source(cfg: TrainConfig) -> str:
    """Where a run's reduced vocabularies come from (``corpus``), for error messages."""
    d = cfg.data
    if d.task != "files":
        return f"data.task {d.task}"
    return f"data.train_path {d.train_path}" + (f", data.eval_path {d.eval_path}"
                                                 if d.eval_size else "")


def tokenizer_mismatch(state: dict, policies: list[Policy], cfg: TrainConfig) -> str | None:
    """None if every policy's tokenizer is the one ``state`` (a training checkpoint of ``cfg``)
    records for its agent (by name; a checkpoint without the record: not checked), else which
    agent's is not and a likely cause: its weights would be read with other tokens."""
    want = dict(zip([a.get("name") for a in state.get("agents", [])],
                    state.get("tokenizers") or []))
    recorded = saved_vocabs(state)
    named = _recorded_tokenizer_names(state)
    for pol in policies:
        if pol.name in want and want[pol.name] != tokenizer_digest(pol.tokenizer,
                                                                   named.get(pol.name)):
            why = (f"its reduced vocabulary is the checkpoint's record: did tokenizer "
                   f"{pol.tokenizer.name!r}'s files change since?" if pol.tokenizer.kept_ids() ==
                   recorded.get(pol.name) else f"a vocabulary reduced to data that changed "
                   f"since? {vocab_source(cfg)}")
            return (f"agent {pol.name}'s tokenizer ({pol.tokenizer.vocab_size} tokens) is not "
                    f"the one its weights were trained with ({why})")
    return None


def encoding_mismatch(state: dict, policies: list[Policy]) -> str | None:
    """None if every policy's tokenizer encodes text as it did when ``state`` (a training
    checkpoint) was written (by agent name; a checkpoint without the record: not checked),
    else which agent's does not and the likely cause (the first: :func:`encoding_mismatches`
    has them all). Its ids still mean the same tokens (:func:`tokenizer_mismatch`), but its
    prompts are other ids than those it trained on."""
    bad = encoding_mismatches(state, policies)
    return bad[0][1] if bad else None


def encoding_mismatches(state: dict, policies: list[Policy]) -> list[tuple[str, str]]:
    """``(agent name, why)`` for each policy whose tokenizer does not encode text as it did
    when ``state`` was written, in the policies' order (see :func:`encoding_mismatch`)."""
    want = dict(zip([a.get("name") for a in state.get("agents", [])],
                    state.get("encodings") or []))
    return [(pol.name,
             f"agent {pol.name}'s prompts are not encoded as when its weights were "
             f"trained: the chat template or encoding rules (BOS, normalizer, "
             f"pre-tokenizer, merges) of its tokenizer {pol.tokenizer.name!r} changed "
             f"since the checkpoint (its files edited, a transformers / tokenizers "
             f"upgrade?)")
            for pol, now in zip(policies, encoding_digests(policies))
            if pol.name in want and want[pol.name] != now]


def _recorded_tokenizer_names(state: dict) -> dict[str, str]:
    """The name each agent's tokenizer folder had in the checkpoint's run (its folder's name,
    part of tokenizer_digest), by agent name: one moved since under another name is the same
    tokenizer."""
    out = {}
    for a in (state.get("config") or {}).get("agents") or []:
        pol = a.get("policy") if isinstance(a, dict) else None
        if isinstance(pol, dict) and is_folder("tokenizer", spec := pol.get("tokenizer")):
            out[pol.get("name")] = os.path.basename(os.path.normpath(spec))
    return out


def tokenizer_digest(tok, name: str | None = None) -> str:
    """Hash of what a tokenizer's ids mean: its class, name (``name``: instead of its own),
    special ids and every id's token (a reduced vocabulary: the kept tokens, in id order)."""
    if hasattr(tok, "token_strings"):
        tokens = tok.token_strings()
    else:
        tokens = [tok.decode([i], skip_special=False) for i in range(tok.vocab_size)]
    return _digest([type(tok).__name__, name or tok.name, tok.vocab_size, tok.eos_id,
                    tok.pad_id, tok.bos_id, tokens])


def encoding_digest(tok) -> str:
    """Hash of how a tokenizer turns text into ids, beyond its vocabulary (tokenizer_digest):
    its prompt template (an HF tokenizer's chat template; whether it adds a BOS) and an HF
    tokenizer's encoding rules (normalizer, pre-tokenizer, merges; not the padding or
    truncation a saved tokenizer.json may hold, which hacpo's encodes do not use). The
    warm-start cache keys on it: a chat template changed under the same name (a package
    upgrade, an edited tokenizer folder) kept the vocabulary, and a warm start trained on
    other ids was loaded."""
    parts = [type(tok).__name__, getattr(tok, "template", None), getattr(tok, "_use_chat", None),
             getattr(tok, "_add_bos", None)]
    hf = getattr(tok, "hf", None)
    if hf is not None:
        parts.append(getattr(hf, "chat_template", None))
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None:
            spec = json.loads(backend.to_str())
            spec.pop("padding", None), spec.pop("truncation", None)
            parts.append(spec)
    return _digest(parts, default=repr)


def _state_digest(module: torch.nn.Module) -> str:
    """Hash of a module's state: every entry's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        if not isinstance(t, torch.Tensor):
            h.update(f"{name}={t!r};".encode())
            continue
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def _cached_warm_start(path: str, pol: Policy) -> dict | None:
    """The cached warm start at ``path`` if there is one that fits ``pol`` (the same entries,
    shapes and dtypes); None otherwise, with a warning where a file was there but unusable
    (nothing of it is loaded; the warm-up trains again and replaces it)."""
    if not os.path.exists(path):
        return None
    try:
        state = ckpt.load(path)
    except (RuntimeError, OSError) as e:   # unreadable, or removed since the check
        log.warning(f"[warm-up] {pol.name}: ignoring the cached warm start, {e}; "
                    "training it again")
        return None
    problem = _state_misfit(state, pol)
    if problem is None:
        return state
    log.warning(f"[warm-up] {pol.name}: ignoring the cached warm start {path}: it does not "
                f"fit the policy ({problem}); training it again")
    return None


def _state_misfit(state, pol: Policy) -> str | None:
    losses = state.get("losses") if isinstance(state, dict) else None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) \
            or not isinstance(losses, list) or not losses \
            or not all(type(x) in (int, float) for x in losses):   # (a tensor: a traceback)
        return "not a warm-start file: no model state and losses"
    want, got = pol.state_dict(), state["model"]
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        return f"missing entries {missing[:3]}, unexpected entries {extra[:3]}"
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor) and (not isinstance(g, torch.Tensor)
                                            or g.shape != w.shape or g.dtype != w.dtype):
            have = f"{list(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g)
            return f"{name}: {have} in the file, {list(w.shape)} {w.dtype} in the policy"
    return None


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
    """Each agent's AdamW (torch's; with fp32 master weights for a bfloat16 / float16 policy,
    :func:`hacpo.engine.update.adamw`): the in-process trainer's and the Ray trainer actors'."""
    from .update import adamw
    return [adamw(p.parameters(), lr=a.optim.lr, betas=(a.optim.beta1, a.optim.beta2),
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
