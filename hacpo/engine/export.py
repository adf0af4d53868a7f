"""`hacpo export`: a trained agent as a standalone Hugging Face model directory.

Each agent of a HACPO run stays a single model at inference time; this writes it where other
tools read models: ``<out>/<agent>/`` with ``config.json``, ``generation_config.json`` and
``model.safetensors`` (transformers' ``save_pretrained``), the tokenizer's files, and
``hacpo_export.json`` (the hacpo version that wrote it, the run, step and agent it came from,
the policy settings, and the prompt format the agent was trained on).
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` (or a vLLM engine)
load the directory with nothing of hacpo installed; the tokenizer's chat template renders a
user message as the agent's prompts were.

- HF policies (``policy.kind=hf``) are saved as they are; hacpo's plain-torch decoder
  (``kind=decoder``) is Llama's architecture with fused projections and is saved as a
  ``LlamaForCausalLM`` (:func:`hacpo.models.decoder.to_llama`).
- A Hugging Face tokenizer is saved with hacpo's EOS (the one it samples to, e.g. Llama 3.2's
  ``<|eot_id|>``) and, where hacpo does not use the tokenizer's own chat template, a chat
  template of hacpo's prompt format; the ``char`` tokenizer as an equivalent transformers
  tokenizer (:meth:`hacpo.models.tokenizer.CharTokenizer.to_hf`).
- A vocabulary reduced to the run's corpus (``policy.reduce_vocab``: ids 0..V-1 renumber the
  tokenizer's, which no tokenizer file can express) has no tokenizer files: such an agent is
  refused (with no agents named: skipped, with a line saying why) unless ``tokenizer=False``
  (``--no-tokenizer``), which writes the model alone, reading hacpo's ids (recorded in
  hacpo_export.json).

The policies are rebuilt exactly as `hacpo eval` rebuilds them (the run's own config; a reduced
vocabulary from the checkpoint's record of its tokens, or the run's own corpus for a checkpoint
without one; ``hacpo_export.json`` records them as ``tokenizer.kept_ids``) and the checkpoint's weights are loaded, so every backend
that writes the checkpoint exports alike: the local and Ray trainers, and megatron-core rank
groups (their checkpoint holds the driver's Hugging Face copy, gathered from the TP / PP
shards).

Each agent's directory is written under a temporary name and renamed into place when complete,
so an interrupted export leaves no half-written model; an existing directory is an error unless
``overwrite``, which replaces it only once the new one is complete.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import tempfile
from typing import Callable, Optional, Sequence

import torch

from hacpo import __version__
from hacpo.models.decoder import to_llama
from hacpo.models.tokenizer import CharTokenizer

from . import build, checkpoint as ckpt
from .data import apply_prompt_template
from .errors import StorageError, require
from .eval_harness import CHECKPOINT, _load_run

__all__ = ["export_checkpoint", "EXPORT_FILE", "PLACEHOLDER"]

EXPORT_FILE = "hacpo_export.json"
PLACEHOLDER = "{question}"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DIR_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


def _dir_names(names: Sequence[str]) -> dict[str, str]:
    """Each of a run's agents' folder: its name where that is a plain file name, else
    ``agent<index>`` (``_`` appended while that is another agent's folder, compared
    case-insensitively). Decided over all the run's agents, so an agent's folder does not
    depend on which agents an export names, and no agent gets another's name."""
    plain = [n for n in names if _DIR_RE.match(n) and n not in (".", "..")]
    taken, out = {n.casefold() for n in plain}, {}
    for i, n in enumerate(names):
        if n in plain:
            out[n] = n
            continue
        d = f"agent{i}"
        while d.casefold() in taken:
            d += "_"
        taken.add(d.casefold())
        out[n] = d
    return out


def _why_not(pol_cfg, tokenizer: bool) -> Optional[str]:
    """Why an agent with policy config ``pol_cfg`` cannot be exported (None if it can)."""
    if tokenizer and pol_cfg.reduce_vocab:
        return (f"its vocabulary is reduced to the run's corpus (policy.reduce_vocab=true): "
                f"ids 0..V-1 renumber tokenizer {pol_cfg.tokenizer!r}'s, which its tokenizer "
                f"files cannot express (--no-tokenizer writes the model alone, reading hacpo's "
                f"ids)")
    return None


def _prepends_bos(tok) -> bool:
    """Whether hacpo puts a BOS id before the prompt text's tokens."""
    return isinstance(tok, CharTokenizer) or bool(getattr(tok, "_add_bos", False))


def _chat_template(tok) -> Optional[str]:
    """A Jinja chat template rendering one user message as hacpo's tokenizer template does
    (BOS where hacpo prepends it; the text around the question as is; anything but one user
    message is an error), or None where hacpo used the tokenizer's own chat template (it is
    kept)."""
    if getattr(tok, "_use_chat", False):
        return None
    before, after = tok.prompt_text(PLACEHOLDER).split(PLACEHOLDER, 1)
    if "{% endraw %}" in before + after:
        raise ValueError(f"tokenizer {tok.name!r}: its prompt template holds '{{% endraw %}}'")

    def raw(text):
        return "{% raw %}" + text + "{% endraw %}" if text else ""
    # the agent was trained on single-turn prompts: a system message or a conversation has
    # no rendering in its format (an error, not a silently dropped message)
    return ("{% if messages | length != 1 or messages[0]['role'] != 'user' %}"
            "{{ raise_exception('this model was trained on prompts of one user message "
            "(hacpo export); got ' ~ (messages | map(attribute='role') | join(', '))) }}"
            "{% endif %}"
            + ("{{ bos_token }}" if _prepends_bos(tok) else "") + raw(before)
            + "{{ messages[0]['content'] }}" + raw(after))


def _hf_tokenizer(tok):
    """The transformers tokenizer to save for hacpo tokenizer ``tok`` (a copy: hacpo's are
    cached and shared): its EOS the one hacpo samples to, a pad token where it has none, and
    hacpo's prompt format as its chat template unless hacpo used the tokenizer's own."""
    hf = tok.to_hf() if isinstance(tok, CharTokenizer) else copy.deepcopy(tok.hf)
    hf.eos_token = hf.convert_ids_to_tokens(tok.eos_id)
    if hf.pad_token is None:
        hf.pad_token = hf.convert_ids_to_tokens(tok.pad_id)
    if (template := _chat_template(tok)) is not None:
        hf.chat_template = template
    return hf


def _stored_trainer(state: dict, index: int) -> str:
    """The trainer (torch / megatron) the run's config gave agent ``index``."""
    a = state["config"]["agents"][index]
    return a.get("trainer", "torch") if isinstance(a, dict) else "torch"


def _prompt_record(tok, template: str) -> dict:
    """How a prompt reaches the model in training: the text (the data template, then the
    tokenizer's chat or plain template) with PLACEHOLDER where the question goes, and whether
    a BOS id comes before its tokens (encoded with add_special_tokens=False)."""
    text = tok.prompt_text(apply_prompt_template(template, PLACEHOLDER))
    return {"text": text, "placeholder": PLACEHOLDER, "data_template": template,
            # the chat template's user message (apply_chat_template gives the same ids)
            "chat_user_message": apply_prompt_template(template, PLACEHOLDER),
            "prepend_bos": _prepends_bos(tok),
            "encode": "tokenizer(text, add_special_tokens=False); special-token strings in "
                      "the text are parsed as special tokens",
            "example": tok.prompt_text(apply_prompt_template(template, "What is 2+3?"))}


def _aside(final: str, kind: str) -> str:
    """The name prefix of ``final``'s temporary siblings (``kind`` "tmp": the folder being
    written; "old": the previous export while the new one is renamed in): the writer's host
    and pid in it, so a later export tells a dead writer's leftover (kill -9, the OOM killer)
    by them."""
    return f"{_host_aside(final, kind)}{os.getpid()}."


def _host_aside(final: str, kind: str) -> str:
    """:func:`_aside` up to the pid: every writer's on this host."""
    return f".{os.path.basename(final)}.{kind}-{socket.gethostname()}."


def sweep_dead_exports(final: str) -> list[str]:
    """Remove the temporary siblings of ``final`` that an export killed while writing left
    (``.<agent>.tmp-HOST.PID.*``, a model's size each; ``.<agent>.old-...``: the previous
    export, put back as ``final`` where a kill between the two renames left none), where
    HOST is this host and PID no longer runs. Another host's (a shared filesystem) or a live
    writer's are left alone. Returns those removed."""
    parent, removed = os.path.dirname(final) or ".", []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return removed
    for name in names:
        for kind in ("old", "tmp"):
            prefix = _host_aside(final, kind)
            pid = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
            if not pid.isdigit() or int(pid) == os.getpid() or ckpt._alive(int(pid)):
                continue
            path = os.path.join(parent, name)
            kept = os.path.join(path, "x")
            if kind == "old" and not os.path.lexists(final) and os.path.isdir(kept):
                os.rename(kept, final)          # the previous export, whole
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                removed.append(path)
    return removed


def _write_agent(pol, final: str, *, record: dict, tokenizer: bool,
                 dtype: Optional[torch.dtype], overwrite: bool) -> None:
    """Write one agent's directory to a temporary sibling, then rename it to ``final``."""
    parent, tmp = os.path.dirname(final), None
    try:
        tmp = tempfile.mkdtemp(prefix=_aside(final, "tmp"), dir=parent)
        tok = pol.tokenizer
        model = pol.model if pol.kind == "hf" else to_llama(
            pol.model, eos_id=tok.eos_id, pad_id=tok.pad_id, bos_id=tok.bos_id)
        if dtype is not None:
            model = model.to(dtype)
        record = {**record, "model_class": type(model).__name__}
        # the ids the model reads and writes are the hacpo tokenizer's (EOS: the one hacpo
        # stops sampling at, which may not be the tokenizer file's default eos_token)
        for cfg in (model.config, model.generation_config):
            cfg.eos_token_id, cfg.pad_token_id = tok.eos_id, tok.pad_id
            if tok.bos_id is not None:
                cfg.bos_token_id = tok.bos_id
        # rows past the tokenizer's ids (a checkpoint's padded embedding): hacpo samples from
        # the tokenizer's V only; transformers' generate leaves them out too
        rows = model.get_output_embeddings().weight.shape[0]
        if rows > tok.vocab_size:
            model.generation_config.suppress_tokens = list(range(tok.vocab_size, rows))
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer:
            _hf_tokenizer(tok).save_pretrained(tmp)
        with open(os.path.join(tmp, EXPORT_FILE), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, ensure_ascii=False)
        # the modes other files get (mkdtemp makes 0700; safetensors writes 0600)
        umask = ckpt.current_umask()
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        if not os.path.lexists(final):
            os.rename(tmp, final)
        elif not overwrite:         # checked up front too: one made since then
            raise FileExistsError(f"{final} exists (--force replaces it)")
        else:                       # the old folder moves aside only for the rename
            old = tempfile.mkdtemp(prefix=_aside(final, "old"), dir=parent)
            try:
                os.rename(final, os.path.join(old, "x"))
            except BaseException:
                os.rmdir(old)
                raise
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(os.path.join(old, "x"), final)
                os.rmdir(old)
                raise
            shutil.rmtree(old, ignore_errors=True)
        tmp = None
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, FileExistsError):
            raise
        raise StorageError.like(e, f"cannot write {final}: {e}", final) from None
    except Exception as e:
        # safetensors (SafetensorError) and tokenizers (a bare Exception) report an I/O error
        # (ENOSPC, EIO, ...) only as "... (os error N)" in their message
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if (m := re.search(r"\(os error (\d+)\)", str(e))) is None:
            raise
        err = int(m.group(1))
        raise StorageError.like(OSError(err, os.strerror(err)),
                                f"cannot write {final}: {e}", final) from None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _holds_the_run(dirs: dict, ck_path: str, run_dir: str, cfg) -> Optional[str]:
    """Why an agent's folder may not be written (None if each may): writing it (``--force``)
    would replace what a run needs: the run dir or the checkpoint exported from, or a folder
    holding them (``--out`` the run dir's parent with an agent of the run dir's name); a
    model or tokenizer folder an agent of the run is built from (``--out`` the folder of the
    base models: eval and --resume of the run read them); another run (a folder holding a
    checkpoint.pt). A link there is replaced itself, never its target: compared as a link."""
    run = [os.path.realpath(p) for p in (ck_path, run_dir)]
    built = {os.path.realpath(p): f"agent {a.policy.name}'s policy.{key}" for a in cfg.agents
             for key in build.MOVABLE if build.is_folder(key, p := getattr(a.policy, key),
                                                         a.policy.kind) and os.path.exists(p)}
    for n, d in dirs.items():
        here = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(d))),
                            os.path.basename(d))

        def holds(p: str) -> bool:
            return os.path.commonpath([here, p]) == here
        what = None
        if any(holds(p) for p in run):
            what = f"the run it is exported from ({run_dir})"
        elif held := [why for p, why in built.items() if holds(p)]:
            what = f"what the run is built from ({', '.join(held)})"
        elif not os.path.islink(d) and os.path.isfile(os.path.join(d, CHECKPOINT)):
            what = f"another run ({os.path.join(d, CHECKPOINT)})"
        if what is not None:
            return (f"cannot export agent {n} to {d}: that folder holds {what}, which writing "
                    f"it would replace (--out chooses another)")
    return None


@build.keeps_torch_threads
def export_checkpoint(checkpoint: str, out_dir: str, *, agents: Optional[Sequence[str]] = None,
                      tokenizer: bool = True, dtype: Optional[str] = None,
                      overwrite: bool = False, moved: Optional[dict] = None,
                      echo: Callable[[str], None] = print) -> dict:
    """Export ``agents`` (default: every agent that can be; the others are skipped, said) of
    a run (run dir or ``checkpoint.pt``) to ``out_dir/<agent>/`` (see the module docstring).
    ``dtype``: the saved weights' dtype (float32, bfloat16, float16; default the policy's).
    ``tokenizer=False``: the model alone. ``moved``: folders moved since the run, as
    :func:`hacpo.engine.eval_harness.evaluate_checkpoints` takes them.
    Returns ``{agent name: directory}``.

    Raises ValueError (an agent that cannot be exported, an unknown agent or dtype, a
    checkpoint whose weights do not fit the run's config), FileExistsError (an agent's
    directory exists and not ``overwrite``), OSError / StorageError (reading or writing),
    MissingPackageError (transformers is not installed)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
    require("transformers", "hacpo export")     # it writes transformers' folders: before any work
    ck_path, run_dir, state, cfg, notes = _load_run(checkpoint, moved, temperature=False,
                                                    max_new_tokens=False, top_p=False)
    for n in notes:
        echo(f"[export] {ck_path}: ignoring {n} (the run's policy build never used it)")
    have = [a["name"] for a in state["agents"]]
    chosen = list(dict.fromkeys(agents)) if agents else have
    if missing := [a for a in chosen if a not in have]:
        raise ValueError(f"unknown agent(s) {missing} in {ck_path}; it holds {have}")
    by_name = {a.policy.name: (i, a.policy) for i, a in enumerate(cfg.agents)}
    if set(by_name) != set(have):
        raise ValueError(f"{ck_path}: its config names agents {sorted(by_name)} but its "
                         f"weights are of {have}")
    bad = {n: why for n in chosen if (why := _why_not(by_name[n][1], tokenizer)) is not None}
    if bad and (agents or len(bad) == len(chosen)):
        # agents named: each must be exported; none named: at least one
        raise ValueError(f"cannot export from {ck_path}: "
                         + "; ".join(f"agent {n}: {why}" for n, why in bad.items()))
    for n, why in bad.items():      # no agent named: the others are exported
        echo(f"[export] skipping agent {n}: {why}")
    chosen = [n for n in chosen if n not in bad]
    folder = _dir_names([a.policy.name for a in cfg.agents])
    dirs = {n: os.path.join(out_dir, folder[n]) for n in chosen}
    if clash := _holds_the_run(dirs, ck_path, run_dir, cfg):
        raise ValueError(clash)
    for d in dirs.values():     # first: a previous export it puts back is one that exists
        if gone := sweep_dead_exports(d):
            echo(f"[export] removed what an export of {d} killed while writing left: "
                 f"{', '.join(os.path.basename(g) for g in gone)}")
    if not overwrite and (there := [d for d in dirs.values() if os.path.lexists(d)]):
        raise FileExistsError(f"{', '.join(there)} already exist(s) (--force replaces them)")
    made = ckpt.first_missing(out_dir)      # the folders it makes (its parents too)
    try:
        ckpt.ensure_dir(out_dir, "export output dir")
    except OSError as e:
        raise StorageError.like(e, f"{e} (--out chooses another)", out_dir) from None
    try:
        _export(ck_path, run_dir, state, cfg, by_name, dirs, tokenizer=tokenizer, dtype=dtype,
                overwrite=overwrite, echo=echo)
    except BaseException:
        ckpt.remove_made_dirs(out_dir, made)     # an error before any agent was written
        raise
    return dirs


def _export(ck_path, run_dir, state, cfg, by_name, dirs, *, tokenizer, dtype, overwrite, echo):
    """export_checkpoint's work once its arguments are checked: rebuild, load, write."""
    chosen = list(dirs)
    echo(f"[export] rebuilding {len(chosen)} polic{'y' if len(chosen) == 1 else 'ies'} from "
         f"{ck_path}")
    policies = {p.name: p for p in build.rebuild_policies(cfg, state, chosen,
                                                          f"cannot export from {ck_path}")}
    if why := build.tokenizer_mismatch(state, [policies[n] for n in chosen], cfg):
        raise ValueError(f"cannot export from {ck_path}: {why}")
    # not an error (a resume's is): an export writes the tokenizer files of now, which may be
    # the ones wanted (a fixed chat template); said, since its prompts are not the run's
    if note := build.encoding_mismatch(state, [policies[n] for n in chosen]):
        echo(f"[export] note: {note}; the folder holds the tokenizer files of now")
    saved = {a["name"]: a for a in state["agents"]}
    for n in chosen:
        pol, (i, pol_cfg) = policies[n], by_name[n]
        try:
            pol.load_state_dict(saved[n]["model"])
        except RuntimeError as e:
            raise ValueError(f"cannot export from {ck_path}: agent {n}'s weights do not fit "
                             f"its policy rebuilt from the run's config "
                             f"({build.vocab_source(cfg)}): {e}") from None
        tok = pol.tokenizer
        record = {
            "hacpo_version": __version__,
            "run_dir": os.path.abspath(run_dir), "checkpoint": os.path.abspath(ck_path),
            "step": state.get("step"), "agent": n, "agent_index": i,
            "trainer": _stored_trainer(state, i),
            "trainer_backend": state["config"].get("trainer_backend", "local"),
            "policy": {k: getattr(pol_cfg, k) for k in (
                ("kind", "arch", "path", "hf_config") if pol_cfg.kind == "hf" else
                ("kind", "d_model", "n_layers", "n_heads", "max_len"))
                + ("tokenizer", "reduce_vocab", "dtype")},
            "dtype": dtype or pol_cfg.dtype,
            "tokenizer": {"name": tok.name, "files_written": tokenizer,
                          "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                          "pad_id": tok.pad_id, "bos_id": tok.bos_id,
                          "reduced": bool(getattr(tok, "reduced", False)),
                          # the tokenizer's id of each of the model's ids (reduced: its files
                          # would misread them; decode through this)
                          "kept_ids": tok.kept_ids()},
            "prompt": _prompt_record(tok, cfg.data.template),
            # the steps from which it trained on prompts its tokenizer encoded otherwise (a
            # resume with --accept-encoding-change, e.g. a fixed chat template)
            "encoding_changes": [int(c["step"]) for c in state.get("encoding_changes") or []
                                 if c.get("agent") == n],
        }
        _write_agent(pol, dirs[n], record=record, tokenizer=tokenizer,
                     dtype=DTYPES[dtype] if dtype else None, overwrite=overwrite)
        echo(f"[export] {n} (step {state.get('step')}) -> {dirs[n]}"
             + ("" if tokenizer else " (model only: no tokenizer files)"))
