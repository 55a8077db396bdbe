"""--load / --finetune / --pretrained-checkpoint on another tool's checkpoint (megatron_lite/checkpointing/
foreign.py, called by checkpoint_arguments.check_checkpoint_paths at parse time and by load.py's survey): a
Megatron-LM torch_dist or legacy torch save, a Hugging Face transformers directory, a DeepSpeed checkpoint, the
root or one checkpoint's own directory, are refused naming the kind and the command that converts them (DeepSpeed:
what to do), on every rank, exit non-zero, no hang. A megatron-lite checkpoint still loads; an empty directory
still starts from scratch; a stray iter_* directory still gets the loader's own message."""

import json
import os
import subprocess
import sys

import pytest
import torch
from distributed_helper import run_distributed
from mcore_reference import requires_mcore, run_script
from pretrain_testing import REPO, flag_error, pretrain_outcome, tiny_pretrain_flags

from megatron_lite.checkpointing import load_checkpoint
from megatron_lite.checkpointing.foreign import describe_foreign

CONVERT = "python tools/checkpoint_convert.py"


# ------------------------------------------------------------------------------------------ the skeletons
def _write(path, content=b""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)


def _megatron_torch_dist(root):
    """What megatron-core's dist_checkpointing.save writes (names as mcore_foreign_save.py's real save), with
    Megatron-LM's tracker: iteration 10."""
    directory = os.path.join(root, "iter_0000010")
    _write(os.path.join(directory, "metadata.json"), json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}))
    torch.save({"iteration": 10, "checkpoint_version": 3.0}, _new(os.path.join(directory, "common.pt")))
    for name in (".metadata", "__0_0.distcp", "__0_1.distcp"):
        _write(os.path.join(directory, name), b"\x00" * 16)
    _write(os.path.join(root, "latest_checkpointed_iteration.txt"), "10")


def _megatron_legacy(root, rank_dir="mp_rank_00", tracker="10", directory="iter_0000010"):
    """Megatron-LM's --ckpt-format torch: one file per model-parallel rank (mp_rank_TP[_PP]), distrib_optim.pt
    beside it with the distributed optimizer."""
    weights = {"embedding.word_embeddings.weight": torch.zeros(8, 4)}
    path = os.path.join(root, directory, rank_dir, "model_optim_rng.pt")
    torch.save({"iteration": 10, "checkpoint_version": 3.0, "model": weights}, _new(path))
    torch.save({"param_state": {}}, os.path.join(root, directory, rank_dir, "distrib_optim.pt"))
    _write(os.path.join(root, "latest_checkpointed_iteration.txt"), tracker)


def _hugging_face(root, weights="model.safetensors"):
    _write(os.path.join(root, "config.json"), json.dumps({"model_type": "gpt2", "n_layer": 2}))
    header = json.dumps({"wte": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    _write(os.path.join(root, weights), len(header).to_bytes(8, "little") + header + b"\x00" * 8)


def _deepspeed(root):
    step = os.path.join(root, "global_step100")
    torch.save({"module": {}}, _new(os.path.join(step, "mp_rank_00_model_states.pt")))
    torch.save({"optimizer_state_dict": {}}, os.path.join(step, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    _write(os.path.join(root, "latest"), "global_step100")
    _write(os.path.join(root, "zero_to_fp32.py"), "# DeepSpeed's consolidation script\n")


def _megatron_saving(root, complete=_megatron_torch_dist):
    """A Megatron-LM root while (or after a crash while) it writes iteration 20: Megatron-LM writes in place,
    dist_checkpointing's metadata.json last and the tracker after it, so the newest iter_ directory holds
    common.pt and .distcp files only (legacy: an mp_rank_00 without its file yet); the tracker says 10."""
    complete(root)
    saving = os.path.join(root, "iter_0000020")
    if complete is _megatron_torch_dist:
        torch.save({"iteration": 20}, _new(os.path.join(saving, "common.pt")))
        _write(os.path.join(saving, "__0_0.distcp"), b"\x00" * 16)
    else:
        os.makedirs(os.path.join(saving, "mp_rank_00"))


def _megatron_beside_lite(root):
    """A megatron-lite root (complete iteration 2) into which Megatron-LM saved iteration 10."""
    _write(os.path.join(root, "iter_0000002", "manifest.json"), "{}")
    _megatron_legacy(root)


def _new(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


MEGATRON_ROOT = "holds Megatron-LM checkpoints"
KINDS = {  # name -> (builder, the --load directory inside tmp_path, what the message must say)
    "megatron-torch_dist": (_megatron_torch_dist, ".", [MEGATRON_ROOT, "torch_dist format", "newest: 10",
                                                        f"{CONVERT} --from megatron --input {{root}} --output NEW_DIR",
                                                        "pretrain_gpt.py --load NEW_DIR",
                                                        "pretrain_gpt.py --finetune --load NEW_DIR"]),
    "megatron-torch_dist-iter-dir": (_megatron_torch_dist, "iter_0000010", [
        "is one Megatron-LM checkpoint", "torch_dist format",
        f"{CONVERT} --from megatron --input {{root}} --iteration 10 --output NEW_DIR"]),
    "megatron-legacy": (_megatron_legacy, ".", [MEGATRON_ROOT, "legacy torch format", "newest: 10",
                                                f"{CONVERT} --from megatron --input {{root}} --output NEW_DIR"]),
    "megatron-legacy-pipeline": (lambda r: _megatron_legacy(r, rank_dir="mp_rank_00_000"), ".",
                                 [MEGATRON_ROOT, "legacy torch format"]),
    "megatron-legacy-iter-dir": (_megatron_legacy, "iter_0000010", [
        "is one Megatron-LM checkpoint", "legacy torch format",
        f"{CONVERT} --from megatron --input {{root}} --iteration 10 --output NEW_DIR"]),
    "megatron-release": (lambda r: _megatron_legacy(r, tracker="release", directory="release"), ".",
                         [MEGATRON_ROOT, "newest: release",
                          f"{CONVERT} --from megatron --input {{root}} --output NEW_DIR"]),
    "megatron-torch_dist-saving": (_megatron_saving, ".", [
        MEGATRON_ROOT, "torch_dist format", "newest: 10",
        f"{CONVERT} --from megatron --input {{root}} --output NEW_DIR"]),
    "megatron-legacy-saving": (lambda r: _megatron_saving(r, _megatron_legacy), ".", [
        MEGATRON_ROOT, "legacy torch format", "newest: 10"]),
    "megatron-beside-lite": (_megatron_beside_lite, ".", [
        "holds Megatron-LM checkpoints (legacy torch format (mp_rank_*/model_optim_rng.pt); newest: 10)",
        f"{CONVERT} --from megatron --input {{root}} --output NEW_DIR",
        "also holds megatron-lite checkpoints (newest: iteration 2): to resume from those, move the newer "
        "Megatron-LM ones away"]),
    "hugging-face": (_hugging_face, ".", ["is a Hugging Face transformers model (model_type 'gpt2')",
                                          f"{CONVERT} --from hf --input {{root}} --output NEW_DIR",
                                          "pretrain_gpt.py --finetune --load NEW_DIR"]),
    "hugging-face-bin": (lambda r: _hugging_face(r, "pytorch_model.bin"), ".", [
        "is a Hugging Face transformers model", "the converter reads safetensors", "save_pretrained()",
        f"{CONVERT} --from hf --input {{root}} --output NEW_DIR"]),
    "deepspeed": (_deepspeed, ".", ["is a DeepSpeed checkpoint (newest: global_step100)", "no converter",
                                    "zero_to_fp32.py script DeepSpeed saves in {root}", "--from hf"]),
    "deepspeed-step-dir": (_deepspeed, "global_step100", ["is a DeepSpeed checkpoint (one step's directory)",
                                                          "zero_to_fp32.py script DeepSpeed saves in {root}"]),
}


def _build(tmp_path, kind):
    """The skeleton of `kind` in tmp_path / kind; returns (its root, the directory given to --load)."""
    builder, inside, _ = KINDS[kind]
    root = str(tmp_path / kind)
    builder(root)
    return root, os.path.normpath(os.path.join(root, inside))


def _expected(kind, root):
    return [text.format(root=root) for text in KINDS[kind][2]]


# ------------------------------------------------------------------------------------------ describe_foreign
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_is_named_with_its_command(tmp_path, kind):
    """Would catch a kind read as megatron-lite's (the old 'has no manifest.json ... Move it away to resume from
    scratch', or for Hugging Face and DeepSpeed no checkpoint at all: a silent start from scratch), or a command
    that names another directory than the one to convert."""
    root, given = _build(tmp_path, kind)
    message = describe_foreign(given)
    assert message is not None and message.startswith(given), message
    for text in _expected(kind, root):
        assert text in message, (text, message)


def test_megatron_lite_and_other_directories_are_not_foreign(tmp_path):
    """Would catch a refusal of directories the loader takes: missing, empty, unrelated files, a stray
    iter_* directory (the loader's own message stays), a megatron-lite root even with an older Megatron-LM
    checkpoint or a transformers export inside it."""
    assert describe_foreign(str(tmp_path / "missing")) is None
    assert describe_foreign(str(tmp_path)) is None
    _write(str(tmp_path / "notes.txt"), "hello")
    _write(str(tmp_path / "config.json"), "{}")  # no weights beside it
    os.makedirs(tmp_path / "iter_0000003")
    assert describe_foreign(str(tmp_path)) is None
    lite = tmp_path / "lite"
    _megatron_legacy(str(lite), directory="iter_0000001")
    _write(str(lite / "iter_0000002" / "manifest.json"), "{}")  # megatron-lite's newest
    _hugging_face(str(lite))
    assert describe_foreign(str(lite)) is None


# ------------------------------------------------------------------------------------------ where it is refused
@pytest.mark.parametrize("kind", ["megatron-torch_dist", "megatron-legacy-iter-dir", "hugging-face", "deepspeed"])
@pytest.mark.parametrize("flags", [dict(), dict(finetune=True), "pretrained"])
def test_pretrain_gpt_refuses_at_parse_time(tmp_path, kind, flags, capsys):
    """pretrain_gpt.py --load DIR (also with --finetune) and --pretrained-checkpoint DIR: a flag error (exit 2,
    raised alike by every rank's parse_args before any process group) naming the kind and the command."""
    root, given = _build(tmp_path, kind)
    if flags == "pretrained":
        argv = tiny_pretrain_flags(load=str(tmp_path / "new"), pretrained_checkpoint=given)
        flag = "--pretrained-checkpoint"
    else:
        argv, flag = tiny_pretrain_flags(load=given, **flags), "--load"
    message = flag_error(argv, capsys)
    assert f"error: {flag} {given} " in message, message
    for text in _expected(kind, root):
        assert text in message, (text, message)


def _load_refusal(directory):
    """load_checkpoint on this rank (the library's path, pretrain_gpt.py's parse skipped): its ValueError."""
    try:
        load_checkpoint(directory, None, None, None)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["megatron-legacy", "hugging-face"])
def test_load_checkpoint_refuses_on_every_rank(tmp_path, kind):
    """The library's load_checkpoint on 2 gloo ranks: every rank raises the description (read in the collective
    survey: no rank left waiting). Would catch a Megatron-LM root loaded as 'incomplete' or a transformers
    directory loaded as no checkpoint (None: a run from scratch)."""
    root, given = _build(tmp_path, kind)
    messages = run_distributed(_load_refusal, 2, given)
    assert messages[0] == messages[1] == describe_foreign(given), messages


@requires_mcore
def test_megatron_core_save_refused_by_torchrun_pretrain_gpt(tmp_path, capsys):
    """A real megatron-core 0.16.1 torch_dist save (dist_checkpointing.save of its GPTModel, Megatron-LM's
    tracker): torchrun pretrain_gpt.py --load ROOT on 2 ranks exits non-zero within its timeout, the ranks that
    print naming the kind and the command; --finetune --load ROOT/iter_0000005 names the --iteration form."""
    root = str(tmp_path / "megatron")
    saved = run_script("mcore_foreign_save.py", root)
    assert "metadata.json" in saved["files"] and "common.pt" in saved["files"], saved
    command = f"{CONVERT} --from megatron --input {root} --output NEW_DIR"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "pretrain_gpt.py"), *tiny_pretrain_flags(load=root)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    errors = [line for line in out.stderr.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    # Each rank refuses at parse time, on its own; but torchrun stops the other ranks (SIGTERM) as soon as the
    # first exits, so the second may be stopped before it prints (seen in CI on a loaded machine). That every
    # rank refuses is test_load_checkpoint_refuses_on_every_rank's (the library, both ranks' messages).
    assert out.returncode != 0 and 1 <= len(errors) <= 2, out.stderr[-3000:]
    assert all("torch_dist format" in line and command in line for line in errors), errors
    message = flag_error(tiny_pretrain_flags(load=os.path.join(root, "iter_0000005"), finetune=True), capsys)
    assert f"{CONVERT} --from megatron --input {root} --iteration 5 --output NEW_DIR" in message, message


# ------------------------------------------------------------------------------------------ unchanged
def test_megatron_lite_checkpoint_loads_and_empty_directory_starts_from_scratch(tmp_path):
    """A megatron-lite checkpoint resumes (also beside an older Megatron-LM checkpoint in the same root); an empty
    --load starts from scratch; a stray iter_* directory newer than the checkpoints keeps the loader's message.
    Would catch foreign.py refusing what the loader takes."""
    save = str(tmp_path / "save")
    flags = dict(lr_decay_iters="4")  # one schedule for the save and the resumes
    status, losses = run_distributed(pretrain_outcome, 1, tiny_pretrain_flags(train_iters="2", save=save, **flags))[0]
    assert status == "ok", losses
    _megatron_legacy(os.path.join(save, "old"), directory="iter_0000001")
    os.rename(os.path.join(save, "old", "iter_0000001"), os.path.join(save, "iter_0000001"))
    status, losses = run_distributed(pretrain_outcome, 1, tiny_pretrain_flags(train_iters="3", load=save, **flags))[0]
    assert status == "ok" and sorted(losses) == [3], losses
    os.makedirs(tmp_path / "empty")
    status, losses = run_distributed(pretrain_outcome, 1, tiny_pretrain_flags(train_iters="1",
                                                                                 load=str(tmp_path / "empty")))[0]
    assert status == "ok" and sorted(losses) == [1], losses
    os.makedirs(os.path.join(save, "iter_0000009"))
    status, message = run_distributed(pretrain_outcome, 1, tiny_pretrain_flags(train_iters="4", load=save, **flags))[0]
    assert status == "error" and "iter_0000009 has no manifest.json" in message, message
