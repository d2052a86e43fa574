"""Where rows come from: user files (local or any pyarrow filesystem URI) and built-in samples.

The built-in samples are written once to Parquet under the cache directory, so they go
through the same reader as user data.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from flotilla._cache import cache_dir
from flotilla.errors import DataError

BUILTIN_SOURCES = ("digits", "pycode", "arith", "arith-pairs")
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json"}
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class ResolvedSource:
    """The concrete files behind `data.source`."""

    description: str  # what the user wrote (or the built-in name)
    paths: list[str]  # filesystem paths, sorted
    filesystem: pafs.FileSystem
    format: str  # "parquet", "csv" or "json" (JSON Lines)


def resolve_source(source: str, fmt: str = "auto", max_bytes: int | None = None) -> ResolvedSource:
    if source == "digits":
        return ResolvedSource("digits", [str(_write_digits())], pafs.LocalFileSystem(), "parquet")
    if source == "pycode":
        return ResolvedSource("pycode", [str(_write_pycode(max_bytes))], pafs.LocalFileSystem(), "parquet")
    if source == "arith":
        return ResolvedSource("arith", [str(_write_arith())], pafs.LocalFileSystem(), "parquet")
    if source == "arith-pairs":
        return ResolvedSource("arith-pairs", [str(_write_arith_pairs())], pafs.LocalFileSystem(), "parquet")

    fs, base = filesystem_for(source)
    if _GLOB_CHARS & set(base):
        root = base[: min(base.index(c) for c in _GLOB_CHARS if c in base)].rpartition("/")[0] or "/"
        infos = _list_files(fs, root, source)
        paths = sorted(i.path for i in infos if fnmatch.fnmatch(i.path, base))
        if not paths:
            raise DataError(f"data.source {source!r} matches no files; check the pattern or list {root!r}")
    else:
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise DataError(
                f"data.source {source!r} does not exist{_where_this_runs()}; point `--set data.source=...` at a "
                f"Parquet/CSV/JSON Lines file, a directory of them, or a glob, or use a built-in sample ({', '.join(BUILTIN_SOURCES)})"
            )
        if info.type == pafs.FileType.Directory:
            paths = sorted(
                i.path
                for i in _list_files(fs, base, source)
                if Path(i.path).suffix.lower() in _EXTENSIONS and not Path(i.path).name.startswith((".", "_"))
            )
            if not paths:
                raise DataError(f"data.source {source!r} is a directory with no .parquet, .csv or .jsonl files")
        else:
            paths = [base]
    return ResolvedSource(source, paths, fs, _decide_format(source, paths, fmt))


def _where_this_runs() -> str:
    """For a job submitted to a cluster (`ray job submit`), where its driver looks for local paths."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:  # set by Ray for a submitted job's driver
        return ""
    import socket

    return (f" on {socket.gethostname()}, the cluster node that runs this job's driver (a path on the machine "
            "you submitted from is not copied unless it lies inside --working-dir: put the data in shared "
            "storage, e.g. s3://..., or in the working directory)")


def filesystem_for(location: str, field: str = "data.source") -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path in it for a local path or a URI such as `s3://b/p`."""
    if "://" in location:
        try:
            return pafs.FileSystem.from_uri(location)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
            raise DataError(f"{field} {location!r}: pyarrow cannot open this URI ({e})") from None
    return pafs.LocalFileSystem(), str(Path(location).expanduser().resolve())


def _list_files(fs: pafs.FileSystem, root: str, source: str) -> list[pafs.FileInfo]:
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    except (FileNotFoundError, OSError) as e:
        raise DataError(f"data.source {source!r}: cannot list {root!r} ({e})") from None
    return [i for i in infos if i.type == pafs.FileType.File]


def _decide_format(source: str, paths: list[str], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    kinds = {_EXTENSIONS.get(Path(p).suffix.lower()) for p in paths}
    if len(kinds) == 1 and None not in kinds:
        return kinds.pop()
    raise DataError(
        f"data.source {source!r}: cannot tell the format from the file names "
        f"({', '.join(sorted(Path(p).suffix or '(none)' for p in paths[:5]))}); set `--set data.format=parquet`, `csv` or `json`"
    )


def _atomic_write_parquet(table: pa.Table, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # readers never see a half-written file
    return path


def _write_digits() -> Path:
    """scikit-learn's bundled 8x8 digits: 1797 rows, pixel_0..pixel_63 (0-16) and `target`."""
    path = cache_dir() / "datasets" / "digits.parquet"
    if path.exists():
        return path
    from sklearn.datasets import load_digits

    bunch = load_digits()
    columns = {f"pixel_{i}": pa.array(bunch.data[:, i].astype("float32")) for i in range(bunch.data.shape[1])}
    columns["target"] = pa.array(bunch.target.astype("int64"))
    return _atomic_write_parquet(pa.table(columns), path)


def _write_pycode(max_bytes: int | None) -> Path:
    """A byte-level corpus: the standard library's .py files, in path order, up to max_bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tag = f"py{sysconfig.get_python_version()}-{max_bytes or 'all'}"
    path = cache_dir() / "datasets" / f"pycode-{tag}.parquet"
    if path.exists():
        return path
    names, texts, total = [], [], 0
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    for file in sorted(stdlib.rglob("*.py")):
        if skip & set(file.relative_to(stdlib).parts):
            continue
        text = file.read_bytes().decode("utf-8", errors="replace")
        names.append(str(file.relative_to(stdlib)))
        texts.append(text)
        total += len(text.encode("utf-8"))
        if max_bytes and total >= max_bytes:
            break
    if not texts:
        raise DataError(f"no .py files under {stdlib}; the pycode sample needs the Python standard library sources")
    return _atomic_write_parquet(pa.table({"path": names, "text": texts}), path)


def _write_arith(rows: int = 2000) -> Path:
    """Instructions with one right answer each, for fine-tuning a language model where nothing can be
    downloaded: `prompt` ("What is 12 plus 7?") and `response` ("12 plus 7 is 19."), fixed by a seed."""
    path = cache_dir() / "datasets" / f"arith-{rows}.parquet"
    if path.exists():
        return path
    import random

    rng = random.Random(0)
    prompts, responses = [], []
    for _ in range(rows):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        word, value = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b)])
        prompts.append(f"What is {a} {word} {b}?")
        responses.append(f"{a} {word} {b} is {value}.")
    return _atomic_write_parquet(pa.table({"prompt": prompts, "response": responses}), path)


def _write_arith_pairs(rows: int = 2000) -> Path:
    """`arith`'s questions as preference pairs: `prompt`, `chosen` (the right answer) and `rejected` (the
    same sentence with another operation's result, the mistake of a reader who took the wrong operation;
    off by 1 to 10 where every operation gives the same number)."""
    path = cache_dir() / "datasets" / f"arith-pairs-{rows}.parquet"
    if path.exists():
        return path
    import random

    rng = random.Random(0)
    ops = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
    prompts, chosen, rejected = [], [], []
    for _ in range(rows):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        word = rng.choice(list(ops))
        value = ops[word](a, b)
        wrong = {ops[other](a, b) for other in ops} - {value} or {value + rng.choice([-1, 1]) * rng.randint(1, 10)}
        prompts.append(f"What is {a} {word} {b}?")
        chosen.append(f"{a} {word} {b} is {value}.")
        rejected.append(f"{a} {word} {b} is {rng.choice(sorted(wrong))}.")
    return _atomic_write_parquet(pa.table({"prompt": prompts, "chosen": chosen, "rejected": rejected}), path)
