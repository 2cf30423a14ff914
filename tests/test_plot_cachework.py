"""Fig. 10a (`dhisparse/bench/plot_cachework.py`): the cache's kernel time per step against the hot-cache budget,
from step-profile results at several budgets; repeats of a budget pooled, per session divided by the sessions held."""

from __future__ import annotations

import matplotlib.image as mpimg
import pytest

from dhisparse.bench.plot_cachework import cache_points, is_cache_work_sweep
from dhisparse.bench.plots import plot_results


def _profile(B, resolver, copy, admitted=18, preset="adaptive", busy=50.0):
    fam = {"gemm": 20.0, "resolver": resolver, "cache copy": copy}
    run = {"preset": preset, "C": 18, "admitted": admitted, "wall_ms_median": 60.0,
           "kernels": {"busy_ms": busy, "profiled_wall_ms_per_step": 60.0, "family_ms": fam, "alone_ms": fam,
                       "overlap_ms": 0.0}}
    return {"kind": "step_profile", "config": {"model": "glm5-faithful", "hot_cache_rows": B}, "runs": [run]}


def test_points_sum_the_cache_families_pool_repeats_and_divide_by_the_sessions_held():
    res = [_profile(2048, 1.0, 9.0), _profile(4096, 0.8, 4.2, admitted=16), _profile(4096, 1.2, 4.8, admitted=16),
           _profile(8192, 0.7, 2.3, admitted=10)]
    assert is_cache_work_sweep(res)
    (label, pts), = cache_points(res).items()
    assert label == "adaptive C18" and [p.budget for p in pts] == [2048, 4096, 8192]
    two = pts[1]
    assert (two.resolver_ms.mean, two.copy_ms.mean, two.total_ms.mean) == pytest.approx((1.0, 4.5, 5.5))
    assert (two.total_ms.lo, two.total_ms.hi) == pytest.approx((5.0, 6.0)) and two.sessions == 16
    assert pts[0].per_session_ms.mean == pytest.approx(10.0 / 18) and pts[2].per_session_ms.mean == pytest.approx(0.3)


def test_only_profiles_with_kernel_data_at_two_budgets_make_the_figure(tmp_path):
    assert not is_cache_work_sweep([_profile(4096, 1.0, 4.0), _profile(4096, 1.0, 4.0)])  # one budget
    assert not is_cache_work_sweep([_profile(None, 1.0, 4.0), _profile(4096, 1.0, 4.0)])  # a default budget
    assert not is_cache_work_sweep([_profile(2048, 1.0, 4.0, busy=0.0), _profile(4096, 1.0, 4.0)])  # a CPU profile
    written = plot_results([_profile(2048, 1.0, 9.0), _profile(4096, 0.8, 4.2)], tmp_path)
    assert sorted(p.name for p in written) == ["cache_work.png", "step_profile.png", "step_profile1.png"]
    img = mpimg.imread(tmp_path / "cache_work.png")
    assert img.shape[0] > 300 and img[..., :3].std() > 0.05
