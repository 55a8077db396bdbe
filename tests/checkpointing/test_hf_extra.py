"""The Hugging Face paths' packaging (setup.py's `hf` extra, tools/checkpoint_convert.py --to hf / --from hf,
HuggingFaceTokenizer): one extra that holds every package they need, named the same in setup.py, .ci/run, the
README, docs/ and the error messages; the docs' export folder ignored by git. Runs without the extra itself."""

import ast
import os
import re
import shutil
import subprocess

import pytest
from pretrain_testing import REPO

HF_PACKAGES = ("transformers", "safetensors", "tokenizers")  # --to hf / --from hf, the tokenizer, from_pretrained
# pip install -e ".[a,b]" (quoted or not, escaped in Python strings) or megatron-lite[a]: the extras a text asks for
EXTRA_MENTION = re.compile(r"""(?:megatron-lite|\s\\?["']?\.)\[([A-Za-z0-9_,\- ]+)\]""")
TEXT_SUFFIXES = (".py", ".md", ".sh", ".txt", ".cfg", ".toml", ".ini")
# At the root: git's, pip's and the runs' folders (data/ is the dataset caches); anywhere: bytecode caches.
ROOT_SKIPPED = {".git", "megatron_lite.egg-info", "build", "dist", ".pytest_cache", ".venv", "runs", "checkpoints",
                "data", "hf"}
THIS_FILE = os.path.join("tests", "checkpointing", "test_hf_extra.py")  # its patterns are not requests


def _extras() -> dict:
    """setup.py's extras_require, read without running setup()."""
    with open(os.path.join(REPO, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def _texts():
    """(relative path, text) of the repository's own text files and .ci/run."""
    for root, dirs, names in os.walk(REPO):
        skipped = ROOT_SKIPPED if root == REPO else {"__pycache__"}
        dirs[:] = [d for d in dirs if d not in skipped]
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, REPO)
            if relative != THIS_FILE and (name.endswith(TEXT_SUFFIXES) or relative == os.path.join(".ci", "run")):
                with open(path, encoding="utf-8", errors="replace") as f:
                    yield relative, f.read()


def test_one_hf_extra_is_named_the_same_everywhere():
    """transformers, safetensors and tokenizers live in one extra, `hf`, pinned; every extra the repository's
    texts ask for exists in setup.py, every mention of an extra with a Hugging Face package asks for `hf`, and
    CI installs it. Would catch the README asking for `[thirdparty]` while the docs and the tool's errors ask for
    `[hf]` (which lacked transformers, so the docs' own from_pretrained line failed after following them)."""
    extras = _extras()
    holders = {pkg: [name for name, reqs in extras.items() if any(re.match(rf"{pkg}\b", r) for r in reqs)]
               for pkg in HF_PACKAGES}
    assert holders == {pkg: ["hf"] for pkg in HF_PACKAGES}, holders
    assert all("==" in r for r in extras["hf"]), extras["hf"]  # pinned: no newer (CUDA) torch pulled in
    mentions = {}
    for path, text in _texts():
        for line in text.splitlines():
            for group in EXTRA_MENTION.findall(line):
                for extra in (e.strip() for e in group.split(",")):
                    mentions.setdefault(extra, set()).add(path)
                    hf_line = any(pkg in line for pkg in HF_PACKAGES) or "Hugging Face" in line
                    assert extra in extras, f"{path} asks for the extra [{extra}], which setup.py does not define"
                    assert not hf_line or extra in ("hf", "dev"), f"{path}: {line.strip()}"
    assert {"README.md", os.path.join(".ci", "run"), os.path.join("docs", "pretrain_gpt.md"),
            os.path.join("tools", "checkpoint_convert.py")} <= mentions.get("hf", set()), mentions
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as f:
        installs = [m for line in f if "pip install -e" in line for m in EXTRA_MENTION.findall(line)]
    assert any("hf" in m.split(",") for m in installs), installs


def test_docs_hf_export_folder_is_ignored_by_git():
    """The folder the docs export to (`--output hf/llama --to hf`) is in .gitignore, as runs/ is. Would catch
    a user following the docs from the checkout and finding a model directory among the changes to commit."""
    if shutil.which("git") is None or not os.path.isdir(os.path.join(REPO, ".git")):
        pytest.skip("not a git checkout")
    with open(os.path.join(REPO, "docs", "pretrain_gpt.md"), encoding="utf-8") as f:
        outputs = re.findall(r"--output (\S+) --to hf", f.read())
    assert outputs, "docs/pretrain_gpt.md has no --to hf example"
    for output in outputs:
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", os.path.join(output, "config.json")],
                                 cwd=REPO, timeout=60)
        assert ignored.returncode == 0, f"{output}/ (docs/pretrain_gpt.md's --to hf output) is not in .gitignore"
