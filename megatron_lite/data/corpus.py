"""A small real English corpus on any machine: the docstrings of this interpreter's standard library.

Nothing is downloaded or shipped. `builtin_corpus_documents()` imports a fixed, sorted list of
standard-library modules that exist on every CPython 3.9+ and collects the docstrings of each module
and of the classes, functions, methods and properties it defines (objects re-exported from other
modules are skipped, identical docstrings are kept once). One docstring is one document. About 1.2 MB
of text (5k documents) on CPython 3.11; the same text for the same Python version, whatever the
machine, the working directory or PYTHONHASHSEED.

`ensure_builtin_dataset()` tokenizes it once into a cache directory, so training on real text needs
no data preparation::

    prefix = ensure_builtin_dataset("~/.cache/megatron_lite", build_tokenizer("ByteLevelTokenizer"))
"""

import hashlib
import importlib
import inspect
import os
import sys
import sysconfig
import warnings
from typing import Callable, List, Optional

from .indexed_dataset import IndexedDataset, IndexedDatasetBuilder

CORPUS_VERSION = 1
"""Bump when the collection rules change, so cached datasets are rebuilt."""

MIN_WORDS = 4
"""Shorter docstrings (ast's 'Add', 'BitAnd', ...) are mostly names, not English, and are skipped."""

# Deprecated or removed modules (asyncore, cgi, imp, distutils, ...) are left out, and so are modules
# with import side effects (this, antigravity) or that need a display (tkinter, turtle). A module that
# fails to import on some build (ssl, sqlite3 without their C libraries) is skipped.
STDLIB_MODULES = tuple(sorted("""
    abc argparse ast asyncio.base_events asyncio.coroutines asyncio.events asyncio.futures asyncio.locks
    asyncio.protocols asyncio.queues asyncio.runners asyncio.streams asyncio.subprocess asyncio.tasks
    asyncio.transports base64 bdb bisect builtins bz2 calendar cmd code codecs codeop collections
    collections.abc colorsys compileall concurrent.futures._base concurrent.futures.process
    concurrent.futures.thread configparser contextlib copy copyreg csv dataclasses datetime decimal
    difflib dis doctest email.charset email.encoders email.feedparser email.generator email.header
    email.headerregistry email.iterators email.message email.mime.base email.mime.multipart
    email.mime.text email.parser email.policy email.utils encodings.idna enum filecmp fileinput fnmatch
    fractions ftplib functools genericpath getopt getpass gettext glob graphlib gzip hashlib heapq hmac
    html html.parser http.client http.cookiejar http.cookies http.server imaplib importlib importlib.abc
    importlib.machinery importlib.metadata importlib.resources importlib.util inspect io ipaddress
    itertools json json.decoder json.encoder json.scanner keyword linecache locale logging
    logging.config logging.handlers lzma mailbox math mimetypes modulefinder multiprocessing.connection
    multiprocessing.context multiprocessing.managers multiprocessing.pool multiprocessing.process
    multiprocessing.queues multiprocessing.shared_memory multiprocessing.synchronize netrc ntpath
    numbers opcode operator optparse os pathlib pdb pickle pickletools pkgutil platform plistlib poplib
    posixpath pprint profile pstats py_compile pyclbr pydoc queue quopri random re reprlib rlcompleter
    runpy sched secrets selectors shelve shlex shutil smtplib socket socketserver sqlite3
    sqlite3.dbapi2 ssl stat statistics string stringprep struct subprocess symtable sys sysconfig
    tabnanny tarfile tempfile textwrap threading time timeit token tokenize trace traceback tracemalloc
    types typing unittest.case unittest.loader unittest.main unittest.mock unittest.result
    unittest.runner unittest.suite urllib.error urllib.parse urllib.request urllib.response
    urllib.robotparser uuid warnings wave weakref webbrowser wsgiref.handlers wsgiref.headers
    wsgiref.simple_server wsgiref.util wsgiref.validate xml.dom.expatbuilder xml.dom.minidom
    xml.dom.pulldom xml.etree.ElementTree xml.sax.expatreader xml.sax.handler xml.sax.saxutils
    xml.sax.xmlreader xmlrpc.client xmlrpc.server zipapp zipfile zipimport zoneinfo
""".split()))


def _is_stdlib(module) -> bool:
    """Built-in (compiled-in) or loaded from the standard-library directory, not a same-named file in
    the working directory or site-packages that shadows it."""
    path = getattr(module, "__file__", None)
    if path is None:
        return True
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    platstdlib = os.path.realpath(sysconfig.get_paths()["platstdlib"])
    path = os.path.realpath(path)
    in_site = "site-packages" in path.split(os.sep) or "dist-packages" in path.split(os.sep)
    return not in_site and (path.startswith(stdlib + os.sep) or path.startswith(platstdlib + os.sep))


def _defined_outside_stdlib(code) -> bool:
    """Whether a function was defined in a module outside the standard library (a third-party library
    patching a standard class): such text depends on what the process imported, not on Python."""
    module = sys.modules.get(getattr(code, "__module__", None) or "")
    return module is not None and not _is_stdlib(module)


def builtin_corpus_documents() -> List[str]:
    """Collect the standard library's docstrings, one document each.

    Returns:
        The documents in a fixed order (modules sorted by name, then attributes sorted by name).
    """
    documents, seen = [], set()

    def add(obj) -> None:
        # The object's own __doc__, not inspect.getdoc's inherited one: that would repeat
        # object.__init__'s text for every class without a docstring.
        doc = getattr(obj, "__doc__", None)
        if not isinstance(doc, str):
            return
        doc = inspect.cleandoc(doc)
        if len(doc.split()) >= MIN_WORDS and doc not in seen:
            seen.add(doc)
            documents.append(doc)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DeprecationWarnings of old aliases (typing.io, ...)
        for name in STDLIB_MODULES:
            try:
                module = importlib.import_module(name)
            except Exception:  # not built on this platform (e.g. no _ssl): the corpus is just smaller
                continue
            if not _is_stdlib(module):
                continue
            add(module)
            namespace = vars(module)
            for attr in sorted(namespace):
                obj = namespace[attr]
                if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                    continue
                if getattr(obj, "__module__", None) != module.__name__:
                    continue  # re-exported from elsewhere
                add(obj)
                if inspect.isclass(obj):
                    members = vars(obj)
                    for member_name in sorted(members):
                        member = members[member_name]
                        if isinstance(member, (staticmethod, classmethod)):
                            member = member.__func__
                        if _defined_outside_stdlib(member.fget if isinstance(member, property) else member):
                            continue  # patched in by a library (importing transformers adds Logger methods)
                        if inspect.isroutine(member) or isinstance(member, property):
                            add(member)
    return documents


def write_builtin_dataset(prefix: str, tokenizer) -> str:
    """Tokenize the built-in corpus (eod after every document) into PREFIX.bin/.idx.

    Args:
        prefix: output path without extension.
        tokenizer: any tokenizer from `build_tokenizer` that can read text.

    Returns:
        The prefix.
    """
    with IndexedDatasetBuilder(prefix, tokenizer.vocab_size) as builder:
        for document in builtin_corpus_documents():
            builder.add_document(tokenizer.tokenize(document) + [tokenizer.eod])
    return prefix


def builtin_dataset_name(tokenizer) -> str:
    """A file name that changes with the Python version, the collection rules and the tokenizer.

    The tokenizer is fingerprinted by its class, vocab_size, eod and the ids of a probe sentence, so two
    different tokenizer.json files never share a cached dataset.

    Args:
        tokenizer: the tokenizer the dataset is built with.

    Returns:
        e.g. 'stdlib_docs_v1_py3.11.7_ByteLevelTokenizer_3f2a9c01d4'.
    """
    probe = "The quick brown fox jumps over the lazy dog. Naïve café, 1234 + 5678 = 6912."
    fingerprint = repr((tokenizer.vocab_size, tokenizer.eod, list(tokenizer.tokenize(probe))))
    digest = hashlib.sha1(fingerprint.encode("utf-8")).hexdigest()[:10]
    python = ".".join(str(v) for v in sys.version_info[:3])
    return f"stdlib_docs_v{CORPUS_VERSION}_py{python}_{type(tokenizer).__name__}_{digest}"


def ensure_builtin_dataset(cache_dir: str, tokenizer, log: Optional[Callable[[str], None]] = None) -> str:
    """The built-in corpus as an indexed dataset in `cache_dir`, built on first use.

    Safe under concurrency and interruption: each builder writes its own temporary files and renames
    them into place (the .idx last), and the content is deterministic, so concurrent builders (e.g. all
    ranks at once) produce identical files and an aborted build leaves no dataset behind, only a
    temporary file that the next build ignores.

    Args:
        cache_dir: directory for the dataset (created if needed; '~' is expanded).
        tokenizer: the tokenizer to build it with.
        log: called with one line before a build starts, saying what it does and about how long it takes
            (importing some 200 modules to read their docstrings: 4 s of CPU time on CPython 3.11, byte-level
            tokenization 0.1 s more); not called when the dataset is there already.

    Returns:
        The dataset prefix (open it with `IndexedDataset(prefix)`).
    """
    cache_dir = os.path.expanduser(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    prefix = os.path.join(cache_dir, builtin_dataset_name(tokenizer))
    try:
        IndexedDataset(prefix)
        return prefix
    except ValueError:  # missing or broken: (re)build
        if log is not None:
            log(f"> building the built-in corpus (the docstrings of the Python standard library, about 1.2 MB of "
                f"text) into {prefix}.bin/.idx: once, about 5 s (longer on a busy machine or with a slow "
                f"tokenizer)")
        return write_builtin_dataset(prefix, tokenizer)
