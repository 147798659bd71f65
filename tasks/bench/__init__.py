"""The benchmark stage: harness, statistics, results, comparison, history, reports."""
