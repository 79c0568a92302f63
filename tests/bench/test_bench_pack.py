"""The pack benchmark runs and reports consistent rows (no wall-clock assertions)."""
from axonhpc.bench import pack as bench_pack


def test_run_small_cases():
    rows = bench_pack.run(bandwidth_cases=((2, 1 << 16),), small_cases=((3, 64),), repeats=1)
    assert [r["count"] for r in rows] == [2, 3]
    assert [r["nbytes"] for r in rows] == [1 << 16, 192]
    for r in rows:
        assert r["ours_s"] > 0 and r["baseline_s"] > 0
        assert abs(r["ratio"] - r["baseline_s"] / r["ours_s"]) < 1e-12
        assert abs(r["ours_gbps"] - r["nbytes"] / r["ours_s"] / 1e9) < 1e-9


def test_main_prints_a_table(capsys, monkeypatch):
    monkeypatch.setattr(bench_pack, "DEFAULT_BANDWIDTH_CASES", ((1, 4096),))
    monkeypatch.setattr(bench_pack, "DEFAULT_SMALL_CASES", ((2, 64),))
    bench_pack.main()
    out = capsys.readouterr().out.splitlines()
    assert f"medians of {bench_pack.REPEATS} interleaved rounds" in out[0] and "base/pack" in out[1], out
    assert len(out) == 4


def test_the_copy_bound_copies_between_addresses_equal_modulo_64():
    import numpy as np
    from axonhpc.bench.timing import empty_aligned_like

    base = np.zeros(4096 + 16, dtype=np.float32)
    for k in range(16):  # every 4-byte distance from a cache line
        x = base[k:k + 4096].reshape(64, 64)
        dst = empty_aligned_like(x)
        assert dst.shape == x.shape and dst.dtype == x.dtype and dst.flags.c_contiguous and dst.flags.writeable
        assert (dst.ctypes.data - x.ctypes.data) % 64 == 0
