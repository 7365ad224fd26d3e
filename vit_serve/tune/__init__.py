"""`vit-serve tune MODEL`: the gateway settings with the most images/s whose measured p99 meets a latency target,
found within a time budget, written as a file `vit-serve serve --config FILE` reads. Nothing is imported here,
so that the command line's parser stays light.

- `search`: the search (`tune`).
- `result`: its terms (options, trials, the winner).
- `candidates`: the runtimes it compares (exports, agreement, offline speed).
- `load`: the trial gateways, the images and the concurrent clients.
- `server_process`: a gateway in a process of its own (started, ready, stopped).
- `report`: the tables, the plot and the files.
"""
