"""Tracking pieces that need no Ray: the gate, the registry aliases, URI checks, the curve plot.

The registry tests use a real MLflow SQLite store with real (tiny) model versions.
"""

from __future__ import annotations

import time

import pytest
from mlflow import MlflowClient

from flotilla.spec import GateSpec, load_spec
from flotilla.errors import SpecError, TrackingError
from flotilla.track import (
    CHAMPION,
    alias_version,
    champion_history,
    check_rules,
    check_tracking_uri,
    flatten,
    resolve_tracking_uri,
    rollback_champion,
    set_alias,
)
from tests.services import free_port
from flotilla.track._curves import plot_training_curves
from flotilla.track._gate import compare_with_champion


def test_gate_rules_are_checked_with_their_numbers():
    gate = GateSpec(require=["val_accuracy >= 0.95", "val_loss < 0.2"])
    passed = check_rules(gate, {"val_accuracy": 0.96, "val_loss": 0.1})
    assert passed.passed and passed.numbers == {"gate.val_accuracy": 0.96, "gate.val_loss": 0.1}
    failed = check_rules(gate, {"val_accuracy": 0.94, "val_loss": 0.1})
    assert not failed.passed
    assert "val_accuracy 0.9400 >= 0.95 FAILED" in failed.summary()
    missing = check_rules(GateSpec(require=["val_rmse <= 1"]), {"val_accuracy": 0.9})
    assert not missing.passed and "reported no val_rmse" in missing.summary()


def test_champion_comparison_respects_direction_and_tolerance():
    gate = GateSpec(beat_champion=True, tolerance=0.01)
    decision = check_rules(gate, {})
    compare_with_champion(decision, gate, "classification", 0.955, 0.96, "3", 300)
    assert decision.passed, decision.summary()  # 0.005 worse, within tolerance
    decision = check_rules(gate, {})
    compare_with_champion(decision, gate, "classification", 0.94, 0.96, "3", 300)
    assert not decision.passed and "vs champion v3 0.9600" in decision.summary()
    decision = check_rules(gate, {})
    compare_with_champion(decision, gate, "lm", 5.0, 4.0, "1", 10)  # perplexity: lower is better
    assert not decision.passed
    decision = check_rules(gate, {})
    compare_with_champion(decision, gate, "regression", 1.0, None, None, 10)
    assert decision.passed and "no champion yet" in decision.summary()


def test_a_metric_that_is_not_a_finite_number_never_passes_the_gate():
    """The run that had this test written: train_loss nan, val_accuracy plausible, promoted."""
    nan = float("nan")
    decision = check_rules(GateSpec(require=["val_accuracy >= 0.5"]), {"val_accuracy": 0.9, "train_loss": nan})
    assert not decision.passed and "train_loss nan: not a finite number FAILED" in decision.summary()
    decision = check_rules(GateSpec(require=["val_loss < 1"]), {"val_loss": nan})
    assert not decision.passed
    gate = GateSpec(beat_champion=True)
    decision = check_rules(gate, {})
    compare_with_champion(decision, gate, "regression", nan, 5.0, "2", 10)
    assert not decision.passed  # a NaN rmse does not beat a champion
    decision = check_rules(gate, {})
    compare_with_champion(decision, gate, "classification", 0.5, nan, "2", 10)
    assert decision.passed  # a champion that answers NaN is beaten by any finite candidate


@pytest.mark.parametrize(
    "rule, message",
    [
        ("val_accuracy => 0.9", "is not `<metric> <op> <number>`"),
        ("val_acc >= 0.9", "unknown metric 'val_acc'"),
        ("val_accuracy >= high", "is not `<metric> <op> <number>`"),
    ],
)
def test_malformed_gate_rules_are_rejected_with_the_field(rule, message):
    with pytest.raises(SpecError, match="track.gate.require") as info:
        load_spec(None, [f"track.gate.require=[{rule!r}]"])
    assert message in str(info.value)


def test_gpt_gate_on_accuracy_is_rejected():
    with pytest.raises(SpecError, match="which a gpt run does not report"):
        load_spec(None, ["model.kind=gpt", "data.source=pycode", "track.gate.require=['val_accuracy >= 0.9']"])


def test_unknown_track_key_suggests_the_right_one():
    with pytest.raises(SpecError, match=r"did you mean `track.model_name`"):
        load_spec(None, ["track.modelname=x"])


def test_flatten_spec_into_params():
    params = flatten(load_spec(None, ["model.hidden=[8, 4]"]).model_dump(mode="json"))
    assert params["train.lr"] == "0.001" and params["model.hidden"] == "[8, 4]" and params["track.uri"] == "null"
    assert params["track.gate.require"] == "[]"


def test_default_store_is_mlflows_own_default_in_the_working_directory(tmp_path, monkeypatch):
    """`mlflow ui` run in the same directory (its default: sqlite:///mlflow.db) finds the runs."""
    from mlflow.store.tracking import DEFAULT_TRACKING_URI

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri, artifacts = resolve_tracking_uri(None)
    assert DEFAULT_TRACKING_URI == "sqlite:///mlflow.db"
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert artifacts == (tmp_path.resolve() / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri(None) == ("http://127.0.0.1:5000", None)


def test_unreachable_server_fails_fast_naming_the_uri():
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(TrackingError, match=f"track.uri '{uri}': cannot reach the MLflow tracking server"):
        check_tracking_uri(uri)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "uri, message",
    [("file:///tmp/mlruns", "plain file store is deprecated"), ("bogus://x/y", "is not a usable MLflow store")],
)
def test_misconfigured_uri_is_rejected(uri, message):
    with pytest.raises(TrackingError, match=message):
        check_tracking_uri(uri)


def test_promote_and_roll_back_champion(registry):
    assert set_alias(registry, "m", CHAMPION, "1").describe() == "m@champion: unset -> v1 (promoted)"
    set_alias(registry, "m", CHAMPION, "2")
    change = set_alias(registry, "m", CHAMPION, "4")
    assert change.describe() == "m@champion: v2 -> v4 (promoted)"
    assert champion_history(registry, "m") == ["1", "2", "4"]
    back = rollback_champion(registry, "m")
    assert back.describe("rolled back") == "m@champion: v4 -> v2 (rolled back)"
    assert alias_version(registry, "m", CHAMPION) == "2"
    rollback_champion(registry, "m")
    assert alias_version(registry, "m", CHAMPION) == "1"
    with pytest.raises(TrackingError, match="no earlier champion to roll back to"):
        rollback_champion(registry, "m")


def test_only_a_version_that_passed_its_gate_becomes_champion_unless_forced(registry):
    registry.set_model_version_tag("m", "3", "flotilla.gate", "failed")
    registry.delete_model_version_tag("m", "4", "flotilla.gate")
    set_alias(registry, "m", CHAMPION, "1")
    with pytest.raises(TrackingError, match=r"m v3 failed its gate; champion stays v1. .*--force"):
        set_alias(registry, "m", CHAMPION, "3")
    with pytest.raises(TrackingError, match=r"m v4 has no gate record"):
        set_alias(registry, "m", CHAMPION, "4")
    assert set_alias(registry, "m", "candidate", "3").after == "3"  # other aliases: any version
    assert set_alias(registry, "m", CHAMPION, "3", force=True).describe() == "m@champion: v1 -> v3 (promoted)"


def test_promotions_and_rollbacks_at_once_take_turns_and_lose_none(registry):
    """Eight threads promote and roll back at once against one store: each change happens whole
    under the promotion lock, so the champion history records every promotion in the order the
    alias saw them, and no lock is left behind."""
    import threading

    from flotilla.track import promotion_lock

    order: list[str] = []
    seen = threading.Lock()
    errors: list[Exception] = []

    def promote(version: str) -> None:
        try:
            with promotion_lock(registry, "m"):
                set_alias(registry, "m", CHAMPION, version, locked=True)
                with seen:
                    order.append(version)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=promote, args=(str(1 + i % 4),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    changes = [v for i, v in enumerate(order) if i == 0 or v != order[i - 1]]
    assert champion_history(registry, "m") == changes and alias_version(registry, "m", CHAMPION) == order[-1]
    rollback_champion(registry, "m")
    assert alias_version(registry, "m", CHAMPION) == changes[-2]
    assert [m.name for m in registry.search_registered_models()] == ["m"]  # the lock is gone


def test_a_lock_left_by_a_dead_process_is_taken_over_after_its_lease(registry):
    import time

    from flotilla.track import promotion_lock
    from flotilla.track._registry import LOCK_EXPIRES_TAG, LOCK_OWNER_TAG, LOCK_SUFFIX

    registry.create_registered_model("m" + LOCK_SUFFIX, tags={LOCK_OWNER_TAG: "dead:1:x",
                                                             LOCK_EXPIRES_TAG: str(time.time() - 1)})
    with promotion_lock(registry, "m", wait_s=30):
        set_alias(registry, "m", CHAMPION, "2", locked=True)
    assert alias_version(registry, "m", CHAMPION) == "2"
    registry.create_registered_model("m" + LOCK_SUFFIX, tags={LOCK_OWNER_TAG: "alive:1:x",
                                                             LOCK_EXPIRES_TAG: str(time.time() + 600)})
    with pytest.raises(TrackingError, match="held the promotion lock .* delete that registered model"):
        with promotion_lock(registry, "m", wait_s=0.5):
            pass


def test_a_lock_released_while_another_process_asks_for_it_is_taken(registry, monkeypatch):
    """MLflow's SQL store answers a duplicate name by reading the existing model; when its holder
    releases the lock in that instant, the read fails with RESOURCE_DOES_NOT_EXIST (seen in CI with
    eight promoting threads). The release is injected at that point: the waiter must take the lock."""
    import time

    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore

    from flotilla.track import promotion_lock
    from flotilla.track._registry import LOCK_EXPIRES_TAG, LOCK_OWNER_TAG, LOCK_SUFFIX

    lock = "m" + LOCK_SUFFIX
    registry.create_registered_model(lock, tags={LOCK_OWNER_TAG: "other:1:x",
                                                 LOCK_EXPIRES_TAG: str(time.time() + 600)})
    read = SqlAlchemyStore.get_registered_model
    released = []

    def holder_releases_first(self, name):
        if name == lock and not released:
            released.append(name)
            registry.delete_registered_model(lock)
        return read(self, name)

    monkeypatch.setattr(SqlAlchemyStore, "get_registered_model", holder_releases_first)
    with promotion_lock(registry, "m", wait_s=30):
        set_alias(registry, "m", CHAMPION, "2", locked=True)
    assert released and alias_version(registry, "m", CHAMPION) == "2"
    assert [m.name for m in registry.search_registered_models()] == ["m"]


def test_promote_names_what_exists(registry):
    with pytest.raises(TrackingError, match=r"m has no version '9'; versions: 1, 2, 3, 4"):
        set_alias(registry, "m", CHAMPION, "9")
    with pytest.raises(TrackingError, match=r"no registered model 'nope'; registered models: m"):
        set_alias(registry, "nope", CHAMPION, "1")


def test_promote_command_prints_what_changed(registry, tmp_path, capsys):
    from flotilla.cli import main

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert main(["promote", "--model", "m", "--version", "3", "--tracking-uri", uri]) == 0
    assert main(["promote", "--model", "m", "--version", "4", "--tracking-uri", uri]) == 0
    assert main(["promote", "--model", "m", "--rollback", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["m@champion: unset -> v3 (promoted)", "m@champion: v3 -> v4 (promoted)",
                   "m@champion: v4 -> v3 (rolled back)"]
    assert main(["promote", "--model", "m", "--version", "7", "--tracking-uri", uri]) == 2
    assert "m has no version '7'" in capsys.readouterr().err


def test_training_curves_png(tmp_path):
    history = [
        {"epoch": e, "train_loss": 1 / e, "val_loss": 1.2 / e, "train_accuracy": 0.5 + e / 10, "val_accuracy": 0.4 + e / 10}
        for e in (1, 2, 3)
    ]
    path = plot_training_curves(history, tmp_path / "curves.png", "run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_harness_scores_in_gate_rules_wait_for_flotilla_eval_then_promote(registry, tmp_path):
    """A rule on `eval.<task>.<metric>` is pending until `flotilla eval` logs that score: the version is
    registered but not promoted; once the score is among its run's metrics, the gate is decided again."""
    from flotilla.track import gate_with_scores

    gate = GateSpec(require=["val_perplexity <= 50", "eval.arith.acc >= 0.5"])
    waiting = check_rules(gate, {"val_perplexity": 40.0})
    assert waiting.passed and waiting.verdict == "pending" and waiting.pending == ["eval.arith.acc"]
    assert "eval.arith.acc >= 0.5: not measured yet (`flotilla eval` measures it" in waiting.summary()
    assert check_rules(gate, {"val_perplexity": 60.0}).verdict == "failed"  # a measured rule fails: not waiting
    assert check_rules(gate, {"val_perplexity": 40.0, "eval.arith.acc": 0.6}).verdict == "passed"
    run = registry.create_run(registry.create_experiment("e")).info.run_id
    registry.log_metric(run, "val_perplexity", 40.0)
    version = registry.create_model_version("m", source=str(tmp_path / "src"), run_id=run).version
    registry.set_model_version_tag("m", version, "flotilla.gate", "pending")
    set_alias(registry, "m", CHAMPION, "1")
    registry.set_model_version_tag("m", version, "eval.arith.acc", "0.4")  # measured, and too low: stays where it is
    low = gate_with_scores(registry, "m", version, gate)
    assert low.gate.verdict == "failed" and low.champion is None and alias_version(registry, "m", CHAMPION) == "1"
    assert gate_with_scores(registry, "m", version, gate) is None  # decided: no longer waiting
    registry.set_model_version_tag("m", version, "flotilla.gate", "pending")
    registry.set_model_version_tag("m", version, "eval.arith.acc", "0.7")
    registry.log_metric(run, "eval.arith.acc", 0.1)  # another version's of the same run: not this one's
    high = gate_with_scores(registry, "m", version, gate)
    assert high.gate.verdict == "passed" and alias_version(registry, "m", CHAMPION) == str(version)
    assert registry.get_model_version("m", version).tags["flotilla.gate.eval.arith.acc"] == "0.7"
    with pytest.raises(SpecError, match="unknown metric 'eval_arith'"):
        load_spec(None, ["track.gate.require=[eval_arith >= 0.5]"])


def test_a_waiting_version_must_not_score_worse_than_the_champion_on_the_same_tasks(registry, tmp_path):
    from flotilla.track import gate_with_scores

    gate = GateSpec(require=["eval.arith.acc >= 0.3"], beat_champion=True, tolerance=0.05)
    run = registry.create_run(registry.create_experiment("e")).info.run_id
    version = registry.create_model_version("m", source=str(tmp_path / "src"), run_id=run).version
    registry.set_model_version_tag("m", version, "eval.arith.acc", "0.5")
    registry.set_model_version_tag("m", version, "flotilla.gate", "pending")
    set_alias(registry, "m", CHAMPION, "2")
    moved = gate_with_scores(registry, "m", version, gate, {"eval.arith.acc": (0.5, 0.5, True)}, "1")
    assert moved.gate.verdict == "pending" and "v2 became champion while this version was compared with v1" in \
        moved.gate.summary() and registry.get_model_version("m", version).tags["flotilla.gate"] == "pending"
    worse = gate_with_scores(registry, "m", version, gate, {"eval.arith.acc": (0.5, 0.6, True)}, "2")
    assert worse.gate.verdict == "failed" and worse.champion is None
    assert "eval.arith.acc 0.5000 vs champion v2 0.6000 on the same tasks (higher is better, tolerance 0.05) FAILED" \
        in worse.gate.summary()
    registry.set_model_version_tag("m", version, "flotilla.gate", "pending")
    close = gate_with_scores(registry, "m", version, gate, {"eval.arith.acc": (0.5, 0.54, True),
                                                            "eval.ppl.word_perplexity": (20.0, 21.0, False)}, "2")
    assert close.gate.verdict == "passed" and alias_version(registry, "m", CHAMPION) == str(version)


def test_the_harness_says_which_scores_are_better_higher():
    from flotilla.evaluate import higher_is_better

    assert higher_is_better({"higher_is_better": {"arith": {"acc": True}, "wiki": {"word-perplexity": False}}}) == \
        {"eval.arith.acc": True, "eval.wiki.word_perplexity": False}


def test_an_epoch_is_in_mlflow_once_the_logger_is_flushed(tmp_path):
    """A trial's epoch reaches MLflow before Tune hears of it (a scheduler that stops the trial then
    ends its process): after `flush`, the point is in the store."""
    from flotilla.track import EpochMetricsLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("e"))
    logger = EpochMetricsLogger(uri, run.info.run_id, set())
    for epoch in (1, 2):
        logger.record({"epoch": epoch, "val_accuracy": 0.5 + epoch / 10, "ended_at": time.time()})
        assert logger.flush(timeout_s=60)
        history = client.get_metric_history(run.info.run_id, "val_accuracy")
        assert [(m.step, m.value) for m in history] == [(e, pytest.approx(0.5 + e / 10)) for e in range(1, epoch + 1)]
    logger.record({"epoch": 2, "val_accuracy": 0.0})  # re-reported after a resume: kept once
    assert logger.flush(timeout_s=60)
    assert len(client.get_metric_history(run.info.run_id, "val_accuracy")) == 2
