"""`python -m maxlm.bench [train|data|prepare|checkpoint|plan|attention|grouped_matmul|compare] --config=...`
(maxlm/bench/benchmarks.py)."""

from maxlm import cli
from maxlm.bench import benchmarks

if __name__ == "__main__":
    cli.run(benchmarks.main, benchmarks.define_flags)
