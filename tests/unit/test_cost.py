"""Resource accounting: CPU/GPU-hours and cost from the spec's prices (no Ray needed)."""

from __future__ import annotations

import pytest

from flotilla.cluster import Prices, ResourceUse, prices_for, resource_use
from flotilla.spec import load_spec
from flotilla.errors import SpecError


def test_spec_prices_each_resource_hour():
    spec = load_spec(None, ["cost.cpu_hour=0.04", "cost.gpu_hour=2.5"])
    prices = prices_for(spec.cost)
    assert (prices.cpu_hour, prices.gpu_hour, prices.currency) == (0.04, 2.5, "USD")
    use = resource_use(1800, cpus=3, gpus=2, prices=prices)  # half an hour
    assert (use.cpu_hours, use.gpu_hours) == (1.5, 1.0)
    assert use.cost == pytest.approx(1.5 * 0.04 + 1.0 * 2.5)
    assert "estimated cost 2.5600 USD (prices from the spec's cost section)" in use.describe()
    assert use.metrics() == {"resource_wall_time_s": 1800, "cpu_hours": 1.5, "gpu_hours": 1.0, "estimated_cost": 2.56}


def test_node_label_prices_charge_gpu_nodes_per_gpu_only():
    # A GPU node's label price covers its CPUs: a run on GPUs is charged by its GPU-hours.
    labels = Prices(cpu_hour=0.048, gpu_hour=1.006, currency="USD", source="node labels (flotilla.io/price-per-hour)")
    assert resource_use(3600, cpus=4, gpus=1, prices=labels).cost == pytest.approx(1.006)
    assert resource_use(3600, cpus=4, gpus=0, prices=labels).cost == pytest.approx(4 * 0.048)


def test_no_prices_no_cost_but_the_hours_still_count():
    use = resource_use(7200, cpus=2, gpus=0, prices=Prices(None, None, "USD", ""))
    assert use.cost is None and use.cpu_hours == 4.0
    assert "estimated_cost" not in use.metrics()
    assert "no prices given" in use.describe()


def test_sweep_totals_add_trials():
    a = ResourceUse(10, 1.0, 0.0, 0.5)
    b = ResourceUse(20, 2.0, 1.0, None)
    total = a + b
    assert (total.cpu_hours, total.gpu_hours, total.cost) == (3.0, 1.0, 0.5)
    assert (ResourceUse(1, 1, 0) + ResourceUse(1, 1, 0)).cost is None


def test_bad_prices_are_refused_with_the_field():
    with pytest.raises(SpecError) as e:
        load_spec(None, ["cost.cpu_hour=-1", "cost.currency=dollars"])
    assert "cost.cpu_hour" in str(e.value) and "cost.currency" in str(e.value)


def test_a_run_is_charged_its_full_size_less_the_stretches_it_ran_smaller():
    from flotilla.train import run_resources

    spec = load_spec(None, ["train.num_workers=[1, 2]", "train.cpus_per_worker=2", "cost.cpu_hour=1.0"])
    # 2 workers x 2 CPUs + 1 CPU for Ray Data over 3600 s, setup and restarts included ...
    full = run_resources(spec, 3600)
    assert full.cpu_hours == pytest.approx(5.0)
    # ... and the same when every attempt ran at full size, however short its span.
    assert run_resources(spec, 3600, segments=[{"workers": 2, "from": 100, "to": 3500}]).cpu_hours == pytest.approx(5.0)
    # Half an hour on one worker takes one worker's 2 CPUs off for that half hour.
    shrunk = run_resources(spec, 3600, segments=[{"workers": 2, "from": 0, "to": 1000},
                                                 {"workers": 1, "from": 1000, "to": 2800},
                                                 {"workers": 2, "from": 2800, "to": 3600}])
    assert shrunk.cpu_hours == pytest.approx(5.0 - 2 * 0.5)
