import pandas as pd
import pytest

from flotilla.data import resolve_source
from flotilla.errors import DataError


@pytest.fixture
def files(tmp_path):
    for i in range(3):
        pd.DataFrame({"x": [i], "y": [i]}).to_parquet(tmp_path / f"part-{i}.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / "notes.csv").write_text("a\n1\n")
    return tmp_path


def test_file_directory_glob_and_uri(files):
    assert len(resolve_source(str(files / "part-0.parquet")).paths) == 1
    glob = resolve_source(str(files / "part-*.parquet"))
    assert [p.rsplit("/", 1)[1] for p in glob.paths] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    assert glob.format == "parquet"
    uri = resolve_source(f"file://{files}/part-*.parquet")
    assert uri.paths == glob.paths


def test_mixed_directory_needs_a_format(files):
    with pytest.raises(DataError, match="set `--set data.format=parquet`, `csv` or `json`"):
        resolve_source(str(files))
    assert resolve_source(str(files), "parquet").format == "parquet"


def test_missing_and_unmatched(files):
    with pytest.raises(DataError, match="does not exist"):
        resolve_source(str(files / "nope"))
    with pytest.raises(DataError, match="matches no files"):
        resolve_source(str(files / "*.json"))
    with pytest.raises(DataError, match="pyarrow cannot open this URI"):
        resolve_source("nosuchscheme://bucket/x.parquet")


def test_builtin_samples_are_parquet(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOTILLA_CACHE", str(tmp_path))
    digits = resolve_source("digits")
    frame = pd.read_parquet(digits.paths[0])
    assert frame.shape == (1797, 65) and frame["target"].nunique() == 10
    code = pd.read_parquet(resolve_source("pycode", max_bytes=50_000).paths[0])
    assert {"path", "text"} <= set(code.columns) and code["text"].str.len().sum() >= 50_000 * 0.5
