"""`flotilla eval`'s own parts: task files found and made to travel, the harness's results as
`eval.<task>.<metric>`. The harness against a served model: tests/integration/test_finetune.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flotilla.errors import SpecError
from flotilla.evaluate import task_files, task_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_tasks_are_found_with_their_data(tmp_path):
    names, include = task_files(str(ROOT / "evals" / "arith"), tmp_path / "tasks")
    assert names == ["arith", "arith_gen"]
    for name in ("arith.yaml", "arith_gen.yaml"):
        data = yaml.safe_load((include / name).read_text())["dataset_kwargs"]["data_files"]["test"]
        assert Path(data).is_absolute() and Path(data).is_file()  # relative to the YAML file, made absolute
        rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
        assert len(rows) == 40
    mc = [json.loads(line) for line in (ROOT / "evals" / "arith" / "arith.jsonl").read_text().splitlines()]
    assert all(len(r["choices"]) == 3 and r["choices"][r["answer"]].endswith(".") for r in mc)


def test_bad_task_paths_say_what_is_wrong(tmp_path):
    with pytest.raises(SpecError, match="no task YAML files there"):
        task_files(str(tmp_path / "nothing"), tmp_path / "out")
    (tmp_path / "t.yaml").write_text("task: t\ndataset_path: json\ndataset_kwargs: {data_files: {test: gone.jsonl}}\n")
    with pytest.raises(SpecError, match=r"t.yaml names data file 'gone.jsonl', which is not at .*gone.jsonl"):
        task_files(str(tmp_path / "t.yaml"), tmp_path / "out")
    (tmp_path / "u.yaml").write_text("dataset_path: json\n")
    with pytest.raises(SpecError, match=r"u.yaml is not an lm-evaluation-harness task \(no `task:` name\)"):
        task_files(str(tmp_path / "u.yaml"), tmp_path / "out")


def test_the_harness_results_become_eval_task_metric():
    results = {"results": {"arith": {"alias": "arith", "acc,none": 0.4, "acc_stderr,none": "N/A"},
                           "arith_gen": {"exact_match,none": 0.1, "exact_match,strict-match": 0.05}}}
    assert task_metrics(results) == {"eval.arith.acc": 0.4, "eval.arith_gen.exact_match": 0.1,
                                     "eval.arith_gen.exact_match_strict_match": 0.05}


def test_a_base_url_must_answer_with_the_version_and_runtime_being_scored():
    """`--base-url` is checked by the headers of a few completions: another version, or the same
    version run by another runtime, would put someone else's scores on this one."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from flotilla.evaluate import _check_serves

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("X-Model-Version", "3")
            self.send_header("X-Model-Runtime", "torch")
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"choices": [{"text": "x"}]}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        _check_serves(url, "m", "3", "torch")  # what it serves: fine
        with pytest.raises(SpecError, match=r"answers m with v3, not only v4"):
            _check_serves(url, "m", "4", "torch")
        with pytest.raises(SpecError, match=r"runs m v3 with torch, not onnx-int4: its scores would be another "
                                            r"runtime's. Leave --base-url out"):
            _check_serves(url, "m", "3", "onnx-int4")
    finally:
        server.shutdown()
        server.server_close()
