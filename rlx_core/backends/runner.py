"""A compiled graph: what Backend.compile returns (here, below backends.base, so that core's
host control flow, which Backend.compile_runner reaches, builds on it without an import circle)."""
from __future__ import annotations

import abc


class Runner(abc.ABC):
    """A compiled, shape-specialized graph: inputs (numpy) in, outputs (numpy) out."""

    profile_clock = ""          # what run_profiled's times are ("host clock", "CUDA events", ...)

    @abc.abstractmethod
    def run(self, inputs: dict) -> dict:
        """Run once; returns fresh numpy arrays (the arena is reused by the next run)."""

    def run_fetch(self, inputs: dict, names: tuple) -> dict:
        """run() returning only the outputs `names`; a device backend overrides it to copy
        back only those."""
        out = self.run(inputs)
        return {k: out[k] for k in names}

    def submit(self, inputs: dict, names: tuple, chain: dict):
        """Start a run and return a function that waits for it and gives the outputs `names`.
        `chain` ({input: output}) takes those inputs from the outputs of this runner's last
        submit (`inputs` holds placeholders of their shape). Here the run happens now and the
        chained values come from the host copies of that submit's outputs; a backend whose
        runs overlap the host (`Backend.overlaps`) copies them on its device instead."""
        if chain and not hasattr(self, "_submitted"):
            from ..ir.errors import BackendError

            raise BackendError(f"{type(self).__name__}: a chained run must follow a submit of the same graph")
        last: dict = getattr(self, "_submitted", {})
        inputs = dict(inputs, **{i: last[o].astype(inputs[i].dtype, copy=False).reshape(inputs[i].shape)
                                 for i, o in chain.items()})
        self._submitted = out = self.run_fetch(inputs, tuple(dict.fromkeys((*names, *chain.values()))))
        return lambda: {k: out[k] for k in names}

    def run_profiled(self, inputs: dict) -> tuple:
        """Run once timing every step: (outputs, [(node index, seconds), ...] in run order; a
        node may have several steps). The profiler (`Executable.profile`) builds on this alone,
        so a backend gets profiling by implementing it next to its run loop."""
        from ..ir.errors import BackendError

        raise BackendError(f"{type(self).__name__} cannot time its steps (it has no run_profiled)")
