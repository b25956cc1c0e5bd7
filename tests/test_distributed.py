"""Two JAX processes on the loopback address: the same parameters as one process (DESIGN §8).

Two CPU processes with 2 devices each (``jax.distributed.initialize``, gloo collectives)
form one mesh of 4 devices; Karula runs with its clients split over all of them (the
projection communicates across the processes) and FedAvg with its seeds split
(``tests/_distributed_runs.py`` is the worker and the worked example). Both processes
must end with the parameters, metrics and participants of the unsharded run in this
process. About 30 s on 2 shared CPU cores, most of it compiling.
"""

import numpy as np
from _distributed_runs import NUM_CLIENTS, collect, launch, reference
from _tolerances import reordered_sum

RUNS = ("karula", "fedavg")


def test_two_processes_equal_one_process(tmp_path):
    procs = launch(tmp_path, num_processes=2, local_devices=2, runs=RUNS)
    ref = reference(RUNS)  # compiled here while the workers start up
    outs = collect(procs, timeout=240)
    assert [int(o["process_index"]) for o in outs] == [0, 1]
    assert all(int(o["global_devices"]) == 4 for o in outs)
    # the split runs sum the NUM_CLIENTS clients in another order, over 3 rounds
    tol = reordered_sum(NUM_CLIENTS, rounds=3)
    for name in RUNS:
        # Every process holds the whole (gathered) result, and the same one.
        np.testing.assert_array_equal(outs[0][name], outs[1][name])
        for out in outs:
            assert out[name].shape == ref[name].shape
            scale = np.abs(ref[name]).max()
            np.testing.assert_allclose(out[name], ref[name], rtol=tol, atol=tol * scale)
            np.testing.assert_allclose(out[f"{name}_loss"], ref[f"{name}_loss"], rtol=tol)
            np.testing.assert_array_equal(out[f"{name}_participants"], ref[f"{name}_participants"])
