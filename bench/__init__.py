"""colocd.bench: the benchmarks behind ``colocd bench`` (weights, control, switch) and the process-group study.

Each prints a table, writes a JSON record (``records.write_record``) and measures the physical floor
and the baselines in the same run, so results are ratios.
"""
