"""`kvpilot bench tuning`: how well the tuner chooses, against a measured grid.

Three steps, each a subcommand (vLLM's `vllm bench sweep` shape: measure, then analyse):
- `grid` measures every point of a scenario's grid of scheduler limits on the engine, the way
  `kvpilot tune --local` runs trials (`LocalRunner`: one `kvpilot serve` process, limits changed
  live, each window confirmed against `vllm:cache_config_info`), and keeps each request's
  TTFT, TPOT and inter-token gaps, so any SLO can be judged later;
- `replay` sets SLOs from the grid's own quantiles and replays the tuner as shipped (guide,
  TPE with the SLO constraints, memory-model pruning, re-measurement and the noise-aware
  decision), plain TPE, random search and the grid in random order on the table, each with a
  third of the grid as its budget: the ratio of each one's choice to the best feasible point;
- `confirm` runs the tuner's most common choice against the engine defaults live, in
  interleaved windows on one engine, judged against the replay's SLOs.
Modules: `scenarios` (the loads and grids), `windows` (one measured window), `grid`,
`judge` (a window and a table against SLOs), `replay`, `confirm`, `render` (the printed
tables), `cli`.
"""
