"""Serving logic that needs no Ray: traffic splits, request validation, the `serve` spec section."""

from __future__ import annotations

import os
import random

import pytest
from pydantic import ValidationError

from flotilla.spec import load_spec
from flotilla.errors import SpecError
from flotilla.serve import GenerateRequest, PredictRequest, TrafficSplit
from flotilla.serve._schemas import validation_fields


def test_weighted_split_lands_within_a_point_of_its_weights():
    split = TrafficSplit({"3": 80, "4": 20})
    rng = random.Random(0)
    picks = [split.pick(None, rng) for _ in range(100_000)]
    assert abs(picks.count("4") / len(picks) - 0.20) < 0.01
    assert split.percents() == {"3": 80.0, "4": 20.0}


def test_sticky_callers_always_get_the_same_version_and_the_split_holds_across_callers():
    split = TrafficSplit({"1": 90, "2": 10})
    callers = [f"user-{i}" for i in range(20_000)]
    first = {c: split.pick(c) for c in callers}
    assert all(split.pick(c) == first[c] for c in callers[:2000])
    assert all(TrafficSplit({"1": 90, "2": 10}).pick(c) == first[c] for c in callers[:2000])  # any replica
    assert abs(sum(v == "2" for v in first.values()) / len(callers) - 0.10) < 0.01


def test_zero_weights_get_no_traffic_and_an_all_zero_split_is_refused():
    assert {TrafficSplit({"1": 100, "2": 0}).pick(None) for _ in range(200)} == {"1"}
    with pytest.raises(ValueError, match="positive weight"):
        TrafficSplit({"1": 0})


@pytest.mark.parametrize(
    "body, field, message",
    [
        ({"instances": [[[1]]]}, "instances[0][0]", "a finite number, a string, a boolean or null"),
        ({"instances": [[{"a": 1}]]}, "instances[0][0]", "a finite number, a string, a boolean or null"),
        ({"instances": [["x" * 1001]]}, "instances[0][0]", "at most 1000 characters"),
        ({"instances": [[float("nan")]]}, "instances[0][0]", "finite"),
        ({"instances": [[float("inf")]]}, "instances[0][0]", "finite"),
        ({"instances": [{"a": float("-inf")}]}, "instances[0].a", "finite"),
        ({"instances": [7]}, "instances[0]", "list of feature values or an object"),
        ({"instances": []}, "instances", "at least 1"),
        ({}, "instances", "required field is missing"),
        ({"instances": [[1.0]], "rows": 1}, "rows", "unknown field"),
    ],
)
def test_prediction_requests_are_validated_field_by_field(body, field, message):
    with pytest.raises(ValidationError) as e:
        PredictRequest.model_validate(body)
    fields = validation_fields(e.value)
    assert fields[0].field == field and message in fields[0].message, fields


def test_generation_requests_reject_strings_for_numbers_and_negative_settings():
    assert GenerateRequest.model_validate({"prompt": "def "}).max_tokens == 64
    for body, field in [({"prompt": "x", "max_tokens": "5"}, "max_tokens"), ({"prompt": "x", "top_k": -1}, "top_k"),
                        ({"prompt": "x", "temperature": -0.5}, "temperature"), ({"prompt": None}, "prompt"),
                        ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "seed": 2**63}, "seed"),
                        ({"prompt": "x", "top_k": 2**64}, "top_k"), ({"prompt": "x", "temperature": 1e-320}, "temperature"),
                        ({"prompt": "x", "temperature": 0.009}, "temperature")]:
        with pytest.raises(ValidationError) as e:
            GenerateRequest.model_validate(body)
        assert validation_fields(e.value)[0].field == field
    # The extremes that still sample: torch takes any seed up to 2^63-1; 0 is greedy.
    for temperature, seed in [(0.0, 2**63 - 1), (0.01, 0), (10.0, None)]:
        GenerateRequest.model_validate({"prompt": "x", "temperature": temperature, "seed": seed})


def test_serve_section_errors_name_the_field_and_the_fix():
    with pytest.raises(SpecError) as e:
        load_spec("configs/digits.yaml", ["serve.trafic={champion: 100}", "serve.autoscaling.min_replicas=3",
                                          "serve.traffic={'bad key!': 1}", "serve.route_prefix=v1/"])
    text = str(e.value)
    assert "`serve.trafic`: unknown key; did you mean `serve.traffic`?" in text
    assert "`serve.autoscaling.min_replicas` (3) is above `serve.autoscaling.max_replicas` (2)" in text
    assert "'bad key!': a traffic key is a version number or an alias name" in text
    assert "a route prefix starts with `/`" in text
    with pytest.raises(SpecError, match="must be at least `serve.batching.max_batch_size` \\(32\\)"):
        load_spec("configs/digits.yaml", ["serve.max_ongoing_requests=8"])
    with pytest.raises(SpecError, match="positive sum"):
        load_spec("configs/digits.yaml", ["serve.traffic={champion: 0}"])
    assert load_spec("configs/digits.yaml").serve.host == "127.0.0.1"  # loopback unless configured otherwise
    assert load_spec("configs/digits.yaml").serve.ingress == "auto"
    with pytest.raises(SpecError) as e:
        load_spec("configs/digits.yaml", ["serve.ingress=nginx"])
    assert "serve.ingress" in str(e.value) and "'proxy'" in str(e.value) and "'haproxy'" in str(e.value)


def test_the_haproxy_wrapper_moves_the_all_interface_binds_to_loopback_and_keeps_serve_host(tmp_path):
    """Ray's HAProxy configuration binds the stats page on `*:` and the exporter on `:`; the wrapper
    rewrites both to 127.0.0.1 before HAProxy reads the file (here HAProxy's own config check, `-c`),
    and leaves the HTTP frontend on whatever serve.host said."""
    import subprocess

    from flotilla.runtime import haproxy_wrapper

    wrapper = haproxy_wrapper(tmp_path / "bin")
    assert wrapper is not None and os.access(wrapper, os.X_OK)
    config = tmp_path / "haproxy.cfg"
    config.write_text("defaults\n    mode http\n    timeout client 1s\n    timeout server 1s\n    timeout connect 1s\n"
                      "    option splice-request\n    option splice-response\n"
                      "frontend prometheus\n    bind :9101\n    http-request use-service prometheus-exporter\n"
                      "frontend http_frontend\n    bind *:8000\n    http-request return status 200\n"
                      "listen stats\n  bind *:8404\n  stats enable\n")
    checked = subprocess.run([str(wrapper), "-c", "-f", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    binds = [line.strip() for line in config.read_text().splitlines() if line.strip().startswith("bind")]
    assert binds == ["bind 127.0.0.1:9101", "bind *:8000", "bind 127.0.0.1:8404"]  # serve.host 0.0.0.0 is `*:`
    options = [line.strip() for line in config.read_text().splitlines() if line.strip().startswith("option")]
    assert options == ["option splice-response"]  # request splicing goes (see HAPROXY_BINARY_ENV), the rest stays
    assert haproxy_wrapper(tmp_path / "bin") == wrapper  # written again only when it would change



def test_serve_apps_config_is_a_valid_serve_deploy_file_with_importable_builders():
    import importlib
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from flotilla.serve import AppArgs

    config = ServeDeploySchema.model_validate(yaml.safe_load(Path("serve_apps/config.yaml").read_text()))
    assert config.http_options.host == "127.0.0.1"
    for app in config.applications:
        module, _, attr = app.import_path.partition(":")
        assert callable(getattr(importlib.import_module(module), attr))
        AppArgs.model_validate(app.args)  # unknown keys would fail at deploy time
        assert "tracking_uri" not in app.args  # the registry comes from each node's MLFLOW_TRACKING_URI
        assert app.route_prefix == f"/v1/models/{app.name}"


def test_serve_app_builders_say_what_they_need():
    from flotilla.errors import ServeError
    from flotilla.serve import build_app

    with pytest.raises(ServeError, match=r"serve_apps.classifier:app needs model=NAME .* or config=SPEC.yaml"):
        build_app({}, "classifier")
    with pytest.raises(ServeError, match="give one of alias=, version= or traffic="):
        build_app({"model": "digits", "alias": "champion", "version": "3"}, "classifier")


def test_serve_runtime_takes_a_variant_only_when_it_passed_and_auto_the_fastest_that_did():
    from flotilla.errors import BundleError
    from flotilla.bundle import choose_runtime

    records = {"torch": {"speed": {"per_s": 100.0}},
               "onnx": {"passed": True, "reason": "ok", "speed": {"per_s": 150.0}},
               "onnx-int8": {"passed": False, "reason": "accuracy drop 0.90 points (at most 0.5)", "speed": {"per_s": 300.0}}}
    assert choose_runtime(records, "auto", "digits v1") == "onnx"  # int8 is faster, but failed its gate
    assert choose_runtime(records, "onnx", "digits v1") == "onnx"
    assert choose_runtime(records, "torch", "digits v1") == "torch"
    with pytest.raises(BundleError, match=r"digits v1: its onnx-int8 variant failed its gate \(accuracy drop 0.90"):
        choose_runtime(records, "onnx-int8", "digits v1")
    with pytest.raises(BundleError, match="digits v1 has no onnx variant; build it with `flotilla export"):
        choose_runtime({}, "onnx", "digits v1")
    assert choose_runtime({}, "auto", "digits v1") == "torch"  # nothing exported: torch
    slow = {**records, "onnx": {**records["onnx"], "speed": {"per_s": 90.0}}}
    assert choose_runtime(slow, "auto", "digits v1") == "torch"


def test_the_wrapper_directory_is_this_users_own_or_not_used(tmp_path):
    """Another local user who makes the predictable directory first (or a link in its place) cannot
    plant the program Serve runs: a directory not owned by this user, or a link, is passed over for
    the next candidate; one of this user's that others may write is made private."""
    import stat

    from flotilla import runtime

    theirs, link, loose, ok = tmp_path / "theirs", tmp_path / "link", tmp_path / "loose", tmp_path / "ok"
    theirs.mkdir()
    if os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    os.chown(theirs, 4242, 4242)
    link.symlink_to(tmp_path)
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    assert runtime._runnable_directory([theirs, link, ok]) == ok
    assert runtime._runnable_directory([loose]) == loose and stat.S_IMODE(loose.stat().st_mode) == 0o700
    wrapper = runtime.haproxy_wrapper(ok)
    if wrapper is not None:
        assert stat.S_IMODE(wrapper.stat().st_mode) == 0o700 and wrapper.stat().st_uid == os.getuid()


def test_the_wrapper_goes_where_programs_may_run_and_auto_falls_back_to_the_proxy_without_one(tmp_path, monkeypatch):
    """A temporary directory mounted noexec (common on hardened hosts) is passed over for the next
    candidate; where no HAProxy can run, `auto` starts the cluster with Serve's Python proxy while an
    explicit `haproxy` still asks Ray for it (and Ray says what is missing)."""
    import subprocess

    from flotilla import runtime

    noexec, ok = tmp_path / "noexec", tmp_path / "ok"
    noexec.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,size=1m", "tmpfs", str(noexec)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a noexec tmpfs here: {mounted.stderr.strip()}")
    try:
        assert runtime._runnable_directory([noexec, ok]) == ok
        assert runtime._runnable_directory([noexec]) is None
    finally:
        subprocess.run(["umount", str(noexec)], check=True)

    monkeypatch.delenv(runtime.HAPROXY_BINARY_ENV, raising=False)
    monkeypatch.setattr(runtime, "haproxy_wrapper", lambda directory=None: None)  # as on a machine without HAProxy
    assert runtime.haproxy_environment("auto") == {}
    assert runtime.haproxy_environment("haproxy") == {**runtime.HAPROXY_ENV, runtime.DRAIN_ENV: runtime.DRAIN_S}
    monkeypatch.setattr(runtime, "haproxy_wrapper", lambda directory=None: tmp_path / "haproxy")
    assert runtime.haproxy_environment("auto")[runtime.HAPROXY_BINARY_ENV] == str(tmp_path / "haproxy")


def test_each_app_answers_every_error_in_its_one_shape():
    """An unexpected exception (500), an unknown route (404) and a wrong method (405): the chat app
    answers them in OpenAI's shape, the others in Flotilla's; nothing as FastAPI's `{"detail"}`."""
    import asyncio
    import json

    from starlette.exceptions import HTTPException
    from starlette.requests import Request

    from flotilla.serve._chat import chat_api
    from flotilla.serve._server import classifier_api, generator_api

    request = Request({"type": "http", "method": "DELETE", "path": "/v1/nowhere", "headers": [], "query_string": b""})
    for api in (chat_api, classifier_api, generator_api):
        for exc, status, says in ((RuntimeError("boom"), 500, "internal error (RuntimeError)"),
                                  (HTTPException(404), 404, "no route /v1/nowhere"),
                                  (HTTPException(405), 405, "DELETE is not allowed on /v1/nowhere")):
            handler = api.exception_handlers[HTTPException if isinstance(exc, HTTPException) else Exception]
            answer = asyncio.run(handler(request, exc))
            body = json.loads(answer.body)
            assert answer.status_code == status
            if api is chat_api:
                assert set(body) == {"error"} and says in body["error"]["message"], body
                assert body["error"]["type"] == ("server_error" if status == 500 else "invalid_request_error")
            else:
                assert body["status"] == status and says in body["error"], body


def test_an_error_answer_quoting_the_request_stays_under_16_kb():
    """Fields that quote what the client sent (its keys, in any script) are cut and counted."""
    from flotilla.serve._schemas import ErrorField
    from flotilla.serve._server import ApiError

    quoted = "\u0001" * 5000  # escaped as \u0001 in JSON: six bytes each
    fields = [ErrorField(field=f"instances[{i}].{quoted}", message="\U0001f600" * 5000) for i in range(5000)]
    answer = ApiError(422, "invalid request: " + "\u00e9" * 50_000, fields).response()
    assert answer.status_code == 422 and len(answer.body) <= 16 * 1024
    import json

    body = json.loads(answer.body)
    assert body["fields"] and "more characters" in body["fields"][0]["field"] and "more characters" in body["error"]
