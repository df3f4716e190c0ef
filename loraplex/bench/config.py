"""``ServeBenchConfig``: one ``loraplex bench serve`` invocation, validated on construction.

Scenarios (``scenario``):
  load      closed loop at each concurrency level (one level: the classic run; several: the concurrency sweep, one
            engine, levels in ascending order), base-only and with adapters
  churn     more adapters than the adapter budget holds, beside the same load with every adapter resident
  fairness  a light tenant at a steady rate alone, then beside a heavy tenant at 10x its load (per policy)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.bench.workload import MIXES, SCALES

QUANTIZATIONS = ("int8", "mxfp4")
SCENARIOS = ("load", "churn", "fairness")
KV_SIZINGS = ("workload", "engine")
ARRIVALS = ("poisson", "fixed")
POLICIES = ("fcfs", "vtc")


def parse_levels(value) -> tuple[int, ...]:
    """``16`` / ``"1,16,64"`` / ``[1, 16]`` -> ascending distinct levels."""
    if isinstance(value, str):
        try:
            items = [int(v) for v in value.replace(" ", "").split(",") if v]
        except ValueError:
            raise ValueError(f"concurrency must be an integer or a comma-separated list of integers, got "
                             f"{value!r}") from None
    elif isinstance(value, int):
        items = [value]
    else:
        items = [int(v) for v in value]
    if not items:
        raise ValueError("concurrency needs at least one level")
    for v in items:
        if v < 1:
            raise ValueError(f"concurrency must be >= 1, got {v}")
    return tuple(sorted(set(items)))


@dataclass
class ServeBenchConfig:
    scale: str = "full"                   # full (GPT-OSS-20B shape) | tiny (CPU smoke)
    scenario: str = "load"                # load | churn | fairness (module docstring)
    num_adapters: int = 8
    rank: int = 32
    concurrency: int | tuple = 16         # one level, or several (the sweep); afterwards ``levels`` holds them and
    #                                       ``concurrency`` the largest
    num_requests: int = 64                # per scenario (per level; see requests_per_client)
    requests_per_client: int | None = None  # per level: max(num_requests, this x C); default 2 in a sweep, else off
    repeats: int = 1                      # load: each level measured this many times in a row (samples #1..#N)
    input_len: int = 1600
    output_len: int = 600
    mix: str = "even"                     # even | zipf | uniform
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"                   # auto: bfloat16 on CUDA, float32 on CPU
    max_num_batched_tokens: int | None = None   # None: the engine's default (4096 on CUDA, 2048 on CPU)
    block_size: int = 16
    base_only: bool = True                # also run the base-only scenario
    quantization: str | None = None       # "int8" / "mxfp4": the engine's experts quantised from the start (one phase)
    int8: bool = False                    # after the float phase, a second engine with INT8 experts, same scenarios
    tensor_parallel_size: int = 1
    enforce_eager: bool = False           # no CUDA graphs for decode steps
    async_scheduling: bool | None = None  # overlapped decode steps; None: the engine's default (on with graphs)
    mixed_cuda_graphs: bool = True        # steps with prefill chunks through CUDA graphs (the engine's default)
    cuda_graph_max_batch_size: int | None = None  # None: the engine's default
    kv_sizing: str | None = None          # engine: its defaults (KV from free memory); workload: sized to the
                                          # workload; None: engine at full scale, workload for tiny CPU runs
    hf_baseline: bool = False
    hf_only: bool = False                 # only the HF baseline (no engine scenarios)
    hf_output_len: int | None = None      # HF output tokens (default: output_len)
    warmup: bool = True
    stagger_s: float = 0.0                # client k starts k * stagger_s seconds in (0: all at once)
    ramp: float | str | None = None       # first requests spread over this many seconds ("auto": the previous
    #                                       level's e2e estimate); default: stagger_s for one level, "auto" in a sweep
    profile_steps: int = 0                # > 0: profile this many decode steps per scenario kind (first phase)
    # speculative decoding (loraplex/bench/speculative.py): ngram | draft | replay (recorded outputs at a set rate)
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    speculative_draft_model: str | None = None
    speculative_acceptance_length: float | None = None  # replay: mean tokens per verification (sets the rate)
    speculative_verify_cuda_graphs: bool = False
    scenario_time_s: float | None = None  # no new request starts after this many seconds of a scenario (level)
    total_time_s: float | None = None     # hard stop for the whole run (running requests aborted)
    # adapters and their memory
    adapter_files: int | None = None      # distinct adapter files (default num_adapters); adapter k reads file k % F
    max_loras: int | None = None          # EngineConfig.max_loras (default: none, the adapter memory budget rules)
    max_cpu_loras: int | None = None      # EngineConfig.max_cpu_loras (default: max(16, num_adapters))
    adapter_budget: int | None = None     # GPU memory for this many adapters (churn; -> adapter_memory_bytes)
    adapter_memory_gib: float | None = None  # the same in GiB
    # tenants (fairness)
    scheduling_policies: tuple = ()       # engine phases per policy ("fcfs", "vtc"); () : the engine's default
    light_rate: float = 1.0               # light tenant's requests per second (open loop)
    arrivals: str = "poisson"             # poisson | fixed (light tenant; heavy too when it is open loop)
    light_input_len: int | None = None    # default input_len
    light_output_len: int | None = None   # default output_len
    heavy_factor: float = 10.0            # heavy tenant's open-loop rate = factor x light_rate
    heavy_concurrency: int | None = None  # heavy as a closed loop of this many clients instead
    heavy_n: tuple = (1,)                 # completions per heavy request; one "beside" scenario per value
    light_weight: float = 1.0
    heavy_weight: float = 1.0
    # end to end through the platform (``--url``)
    url: str | None = None
    api_key: str | None = None
    keys_file: str | None = None
    adapter_names: tuple = ()             # with api_key: the tenant's adapters to send requests to
    base_model: str | None = None         # the base model's name at the endpoint (default: first of /v1/models)
    vocab_size: int | None = None         # prompt token ids in [2, vocab) (default: the scale's vocabulary)
    request_timeout_s: float = 600.0
    # output
    out_dir: str | None = None
    results_dir: str | None = None        # also write <scenario>-<model>-<precision>[-e2e]-<date>.json/.md here
    label: str | None = None              # the scenario part of that name (default: sweep/serve/churn/fairness)
    work_dir: str | None = None           # where config.json and adapters are written (default: a temp dir)
    command: str = ""
    notes: list[str] = field(default_factory=list)
    levels: tuple = field(default=(), init=False)

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"scale {self.scale!r} is not supported; choose one of {', '.join(SCALES)}")
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario {self.scenario!r} is not supported; choose one of {', '.join(SCENARIOS)}")
        if self.mix not in MIXES:
            raise ValueError(f"mix {self.mix!r} is not supported; choose one of {', '.join(MIXES)}")
        if self.stagger_s < 0:
            raise ValueError(f"stagger_s must be >= 0, got {self.stagger_s}")
        self.levels = parse_levels(self.concurrency)
        self.concurrency = max(self.levels)
        if self.scenario != "load" and len(self.levels) > 1:
            raise ValueError(f"the {self.scenario} scenario runs at one concurrency; a list of levels is a sweep "
                             "(scenario load)")
        if self.scenario != "load" and self.repeats != 1:
            raise ValueError(f"repeats applies to the load scenario (its levels); the {self.scenario} scenario "
                             "runs once")
        for name in ("rank", "num_requests", "input_len", "output_len", "block_size", "tensor_parallel_size",
                     "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("requests_per_client", "adapter_files", "max_loras", "max_cpu_loras", "adapter_budget",
                     "cuda_graph_max_batch_size", "heavy_concurrency", "light_input_len", "light_output_len",
                     "vocab_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_adapters < 0:
            raise ValueError(f"num_adapters must be >= 0, got {self.num_adapters}")
        if self.num_adapters == 0 and not self.base_only and not self.hf_only:
            raise ValueError("nothing to run: num_adapters is 0 and the base-only scenario is off")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; choose one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.quantization is not None and self.int8:
            raise ValueError("quantization='int8' already runs INT8 experts; int8 (a second, INT8 phase after the "
                             "float one) goes with an unquantised engine only")
        if self.hf_only:
            self.hf_baseline = True
        for name in ("scenario_time_s", "total_time_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        from loraplex.bench.speculative import speculative_config

        speculative_config(self)  # bad speculative flags: ValueError now
        if self.kv_sizing is None:
            self.kv_sizing = "workload" if self.scale == "tiny" else "engine"
        if self.kv_sizing not in KV_SIZINGS:
            raise ValueError(f"kv_sizing {self.kv_sizing!r} is not supported; choose one of {', '.join(KV_SIZINGS)}")
        if self.ramp is not None:
            if self.ramp != "auto" and (isinstance(self.ramp, bool) or not isinstance(self.ramp, (int, float))
                                        or self.ramp < 0):
                raise ValueError(f"ramp must be 'auto' or a number of seconds >= 0, got {self.ramp!r}")
            if self.stagger_s:
                raise ValueError("give either stagger (seconds between clients) or ramp (seconds for all of them)")
        elif len(self.levels) > 1 and not self.stagger_s:
            self.ramp = "auto"
        if self.requests_per_client is None and len(self.levels) > 1:
            self.requests_per_client = 2
        planned = self.requests_at(self.concurrency)
        if self.scenario == "load" and planned < self.concurrency:
            self.notes.append(f"{planned} requests at concurrency {self.concurrency}: never more than {planned} in "
                              f"flight (--num-requests or --requests-per-client for a run at concurrency "
                              f"{self.concurrency})")
        if self.adapter_budget is not None and self.adapter_memory_gib is not None:
            raise ValueError("give the adapter budget either in adapters (adapter_budget) or in GiB "
                             "(adapter_memory_gib), not both")
        if self.adapter_memory_gib is not None and not self.adapter_memory_gib > 0:
            raise ValueError(f"adapter_memory_gib must be > 0, got {self.adapter_memory_gib}")
        if self.adapter_files is not None and self.adapter_files > max(1, self.num_adapters):
            raise ValueError(f"adapter_files ({self.adapter_files}) must be <= num_adapters ({self.num_adapters})")
        if self.scenario == "churn" and self.url is None:  # end to end the budget is the deployment's
            if self.num_adapters < 2:
                raise ValueError("the churn scenario needs at least 2 adapters")
            budget = self.adapter_budget if self.adapter_budget is not None else self.max_loras
            if budget is None and self.adapter_memory_gib is None:
                raise ValueError("the churn scenario needs an adapter budget below the adapter count: "
                                 "adapter_budget (adapters' worth of GPU memory), adapter_memory_gib or max_loras")
            if budget is not None and budget >= self.num_adapters:
                raise ValueError(f"the churn budget ({budget} adapters) must be below num_adapters "
                                 f"({self.num_adapters}): otherwise every adapter stays resident")
        self.scheduling_policies = tuple(self.scheduling_policies)
        for p in self.scheduling_policies:
            if p not in POLICIES:
                raise ValueError(f"scheduling policy {p!r} is not supported; choose from {', '.join(POLICIES)}")
        if self.scheduling_policies and self.scenario != "fairness":
            raise ValueError("scheduling policies are compared in the fairness scenario only")
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals {self.arrivals!r} is not supported; choose one of {', '.join(ARRIVALS)}")
        for name in ("light_rate", "heavy_factor", "light_weight", "heavy_weight", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self.heavy_n = tuple(self.heavy_n) or (1,)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.heavy_n):
            raise ValueError(f"heavy_n must be integers >= 1, got {self.heavy_n}")
        self.adapter_names = tuple(self.adapter_names)
        if self.url is not None:
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"url must be an http(s) address of the OpenAI API, e.g. http://host:8000/v1; got "
                                 f"{self.url!r}")
            if (self.api_key is None) == (self.keys_file is None):
                raise ValueError("--url needs tenant keys: api_key (one tenant) or keys_file (tenants with their "
                                 "keys and adapters)")
            if self.adapter_names and self.keys_file is not None:
                raise ValueError("adapter names go in the keys file when one is given")
            if self.hf_baseline or self.int8 or self.quantization or self.profile_steps:
                raise ValueError("--url drives a running deployment: the engine options (quantization, int8, HF "
                                 "baseline, profiling) belong to the deployment, not to the bench")
        elif self.api_key is not None or self.keys_file is not None or self.adapter_names:
            raise ValueError("tenant keys and adapter names go with --url (the end-to-end run)")

    @property
    def end_to_end(self) -> bool:
        return self.url is not None

    @property
    def sweep(self) -> bool:
        return len(self.levels) > 1

    def requests_at(self, concurrency: int) -> int:
        """Planned requests of one level."""
        if self.requests_per_client is None:
            return self.num_requests
        return max(self.num_requests, self.requests_per_client * concurrency)

    @property
    def num_adapter_files(self) -> int:
        return self.adapter_files if self.adapter_files is not None else self.num_adapters
