"""`vit-serve tune MODEL`: the gateway settings with the most images/s whose measured p99 meets a latency target,
found within a time budget (`vit_serve.tune.search.tune`), written as a file `vit-serve serve --config FILE`
reads. `result` holds its terms (options, trials, the winner), `candidates` the runtimes it compares (exports,
agreement, offline speed), `load` the trial gateways and their clients, `report` the tables, the plot and the
files. Nothing is imported here, so that the command line's parser stays light.
"""
