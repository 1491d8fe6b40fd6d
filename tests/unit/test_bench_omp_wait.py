"""cluster/bench/omp_wait.py, the bench of OpenMP's wait policy (docs/benchmarks.md): it runs and prints a line per
policy with each process's wall and CPU seconds (its figures are the bench's to measure, not a unit test's)."""
from cluster.bench import omp_wait


def test_the_omp_wait_bench_prints_a_line_per_policy(capsys):
    omp_wait.main(["--procs", "1", "--threads", "1", "--iters", "3", "--policies", "default", "PASSIVE",
                   "GOMP_SPINCOUNT=1000"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("1 process(es) x 1 thread(s), 3 iterations each of width 128"), lines
    assert [line.split()[0] for line in lines[1:]] == ["OMP_WAIT_POLICY=default", "OMP_WAIT_POLICY=PASSIVE",
                                                       "GOMP_SPINCOUNT=1000"], lines
    assert all(" s per process, CPU " in line for line in lines[1:]), lines
