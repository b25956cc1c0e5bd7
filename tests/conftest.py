"""Shared test setup: float32 JAX on the CPU, data paths, compiled programs released."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import _compile_report
import jax
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA:CPU compilation is most of the suite's time: the tests compile with LLVM's
# optimization level 0 instead of XLA's default (no fast math, but not bit-identical to the
# default level: no contraction of multiply-adds; the tests compare programs compiled alike;
# the test programs are small, so slower code costs less than the compile time saved:
# measured in alternating runs of three heavy test files, 100-104 s against 139-142 s at
# level 1, which had itself saved 10% against the default).
# The backend reads XLA_FLAGS when it starts, after this file runs; subprocesses (notebook
# kernels, distributed and sharding runs) inherit it.
# Each xdist worker (one per core) also runs XLA's Eigen operations on one thread rather
# than a pool the size of the machine: two workers with two threads each oversubscribe
# two cores (measured: 8% less wall time on four test files with -n 2). LLVM's expensive
# passes are skipped too (compile time; measured: the projection's and a Karula round's
# compilation 15-30% shorter, the same certified gaps to the bit on the cases compared).
# XLA:CPU's older loop emitters replace its fusion emitters, and each worker generates code
# on one thread (the two workers share two cores): four projection programs compiled in
# 4.6-5.1 s against 7.7-8.3 s, a Karula round in 1.5 s against 2.6-3.2 s; the whole suite
# (-n 2, 807 tests, all passing either way) in 456 s against 699 s, its summed test
# durations 870 s against 1,372 s (2026-11-29, run back to back).
# jax 0.12's XLA has no such switch; its --xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE
# is no substitute (test_projection.py and test_alg_baselines.py, -n 2, back to back: 278 s
# against 258 s without it), so it is not set. Nor do these shorten jax 0.12's compiles
# (8 projection programs and two 50-round scans, 15.4-17.4 s with the flags below, each
# variant within that spread, 2026-12-05): --xla_cpu_emitter_verification_level=0,
# --xla_cpu_use_xnnpack=false, an empty --xla_cpu_experimental_ynn_fusion_type, XNN graph
# fusions off, --xla_cpu_use_thunk_runtime=false, no copy-insertion region analysis, the
# older xtile lowering, --xla_cpu_max_isa=AVX2 or SSE4_2, vector width 128, or glibc's
# malloc tunables (GLIBC_TUNABLES). A profile of them is spread over XLA's MLIR emitters
# (contexts and pattern sets built per fusion) and malloc, no single pass to switch off.
_TEST_XLA_FLAGS = (
    ("--xla_backend_optimization_level", "0"),
    ("--xla_cpu_multi_thread_eigen", "false"),
    ("--xla_llvm_disable_expensive_passes", "true"),
    ("--xla_cpu_use_fusion_emitters", "false"),
    ("--xla_cpu_parallel_codegen_split_count", "1"),
)
# XLA aborts the process on a flag it does not know (jax 0.12's XLA dropped
# --xla_cpu_use_fusion_emitters), and pytest's capture hid its message: the flags are set
# only where this XLA accepts them, learnt once from a child process and inherited by the
# xdist workers; a flag the user set that XLA refuses stops the run with XLA's own words.
_PROBED_VAR = "KARULA_TEST_XLA_FLAGS_REFUSED"
_PROBE = "import jax; jax.numpy.zeros(()).block_until_ready()"


def _refused_flags(flags: str) -> tuple[list[str], str]:
    """The flags of ``flags`` that this XLA refuses, and XLA's message (empty if none)."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    child = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    if child.returncode == 0:
        return [], ""
    match = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", child.stderr)
    if match is None:
        raise pytest.UsageError(f"JAX fails to start with XLA_FLAGS={flags!r}:\n{child.stderr}")
    return [f.split("=")[0] for f in match.group(1).split()], match.group(0)


def _set_test_xla_flags() -> None:
    if _PROBED_VAR in os.environ:  # an xdist worker: the controller has probed and set them
        return
    user = os.environ.get("XLA_FLAGS", "")
    ours = [f"{flag}={value}" for flag, value in _TEST_XLA_FLAGS if flag not in user]
    refused, message = _refused_flags(" ".join([user, *ours]).strip())
    if set(refused) - {flag for flag, _ in _TEST_XLA_FLAGS}:
        raise pytest.UsageError(f"XLA refuses a flag of your XLA_FLAGS ({message})")
    kept = [f for f in ours if f.split("=")[0] not in refused]
    os.environ["XLA_FLAGS"] = " ".join([user, *kept]).strip()
    os.environ[_PROBED_VAR] = " ".join(refused)


_set_test_xla_flags()


def pytest_addoption(parser):
    parser.addoption(
        "--compile-report",
        action="store_true",
        help="print each test module's seconds in JAX tracing, lowering and XLA compilation "
        "(summed over tests and xdist workers; tests/_compile_report.py)",
    )


def pytest_configure(config):
    if config.getoption("compile_report"):
        config.pluginmanager.register(_compile_report.Plugin(), "karula_compile_report")


def pytest_terminal_summary(terminalreporter):
    """Says which XLA flags the tests ran with and which of the test flags this XLA refused."""
    refused = os.environ.get(_PROBED_VAR) or "none"
    terminalreporter.write_line(
        f"XLA_FLAGS: {os.environ['XLA_FLAGS']} (test flags this XLA refused: {refused})"
    )


# One on-disk compilation cache per test run, shared by the xdist workers (they inherit the
# environment of the process that loads this file first): many tests compile the same
# programs from new closures or after the per-module cache release below, and XLA:CPU's
# compile time dominates the suite. Set KARULA_TEST_COMPILATION_CACHE=off to disable.
_CACHE_VAR = "KARULA_TEST_COMPILATION_CACHE"
_OWN_CACHE = None
if os.environ.get(_CACHE_VAR) is None:
    _OWN_CACHE = tempfile.mkdtemp(prefix="karula-jax-test-cache-")
    os.environ[_CACHE_VAR] = _OWN_CACHE
if os.environ[_CACHE_VAR] != "off":
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VAR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # The subprocesses (notebook kernels, sharding and distributed workers) share it too:
    # JAX reads these variables when it is imported. A worker that compiles the same
    # program twice (a new closure of the same function) reads it back the second time;
    # the cache key holds the XLA flags, so a 4-device process gets its own entries.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_VAR]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
    """The process that made the cache folder removes it at the end of the run."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = pathlib.Path(os.environ.get("KARULA_DATA_DIR", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data_dir() -> pathlib.Path:
    """The real data folder (``../shared/data``); it must exist, tests never skip on it."""
    assert SHARED_DATA.is_dir(), f"shared data folder not found at {SHARED_DATA}"
    return SHARED_DATA


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. Every XLA:CPU executable
    keeps memory mappings of its code; a session that keeps all of them crashed in XLA's
    compiler near the end of the suite (segmentation fault, twice in the same test, which
    passes alone), as the process approaches the kernel's limit on mappings
    (``vm.max_map_count``, 65530 by default)."""
    yield
    jax.clear_caches()


# Modules that run a study, a notebook or several processes end to end: the slow tier, which
# `pytest -m "not slow"` (the inner loop) leaves out and the full suite (CI) runs.
_SLOW_MODULES = {
    "test_distributed.py",
    "test_femnist_experiment.py",
    "test_heart_experiment.py",
    "test_notebooks.py",
    "test_sharding.py",
    "test_study_own_method.py",
    "test_synthetic_experiment.py",
}


# The heaviest unit tests, by module and function (every parametrization): the 72
# functions with the longest durations in `pytest -m "not slow" --durations` runs (the
# first 45 were 58% of that tier's test time; 27 more of 3.7-9.3 s each left it at 3.5 min
# on 2 quiet cores, over its 3-minute budget). The fast tier keeps at least one test of every
# module but the doctests (one parametrized function); tests/test_tiers.py checks that.
SLOW_TESTS: dict[str, tuple[str, ...]] = {
    "test_alg_baselines.py": ("test_ifca_with_a_bound_runs_k_traced_and_equals_static_k",),
    "test_alg_common.py": (
        "test_a_round_of_zero_weight_participants_keeps_the_global_model",
        "test_memory_is_updated_in_place",
        "test_nan_loss_is_reported_and_keys_are_shared",
        "test_round_compiles_once",
    ),
    "test_alg_graph.py": ("test_laplacian_penalty_limits_equal_karula",),
    "test_alg_karula.py": (
        "test_odd_and_even_n_reach_cvxpy_optimum_with_partial_participation",
        "test_shared_leaves_reach_consensus_cvxpy",
        "test_t_inf_is_local_training",
        "test_t_zero_is_saga_on_one_model_numpy",
        "test_traced_t_grid_vmapped_and_compiled_once",
    ),
    "test_alg_personalization.py": (
        "test_ditto_global_model_is_fedavg_and_lam_inf_copies_it",
        "test_fedprox_mu_zero_is_fedavg_bit_for_bit",
        "test_scaffold_first_round_is_fedavg_and_personalized_leaves_have_no_control",
        "test_traced_hyperparameters_compile_once_and_batch",
    ),
    "test_bad_inputs.py": (
        "test_every_public_submodule_is_an_attribute",
        "test_karula_trains_on_a_D_symmetric_to_its_tolerance",
    ),
    "test_bench_device.py": ("test_quick_run_writes_every_part_with_its_solver_and_active_share",),
    "test_solver_laplacian_direct.py": ("test_within_the_cap_no_step_is_taken_by_cg",),
    "test_bench_study_time.py": (
        "test_quick_run_prints_the_stages_of_both_runs_and_the_binding_share",
    ),
    "test_benchmarks.py": (
        "test_bare_round_runs_without_the_projection_even_after_the_full_round",
        "test_bench_projection_sweep_over_p_reports_quiet_and_loaded_calls",
        "test_bench_study_times_a_binding_round_and_reports_the_solver",
    ),
    "test_divergence.py": ("test_penalty_own_rule_stable_at_mu_zero_where_karulas_step_diverges",),
    "test_doctests.py": ("test_examples_print_what_they_show",),
    "test_embedding.py": (
        "test_batched_solve_matches_vmap",
        "test_padding_changes_nothing",
        "test_traced_epsilon_or_data_that_the_eager_checks_refuse_give_nan_not_a_plausible_d",
    ),
    "test_linalg.py": ("test_inv_spd_dominant_matches_numpy_unbatched_batched_and_nested_vmap",),
    "test_multinomial.py": (
        "test_karula_trains_it_from_its_own_smoothness",
        "test_smoothness_bounds_the_hessian_and_is_attained_at_two_equal_classes",
    ),
    "test_personalized_argument.py": ("test_default_keeps_the_old_numbers_and_none_is_refused",),
    "test_projection.py": (
        "test_all_zero_radii_give_the_mean_exactly",
        "test_compiles_once_and_runs_in_jit_scan_vmap",
        "test_dtypes_integer_half_and_nan",
        "test_feasible_input_is_returned_as_is",
        "test_hard_cold_starts_converge_to_tight_tolerance",
        "test_large_n_auto_matches_dykstra",
        "test_models_far_inside_their_radii_come_back_as_is",
        "test_multipliers_stay_symmetric_on_one_dimensional_hard_instances",
        "test_newton_ascent_is_monotone_on_degenerate_duals",
        "test_newton_step_is_symmetric_to_the_bit",
        "test_p_larger_than_n_and_solvers_agree_float64",
        "test_personalized_has_the_factories_meaning",
        "test_shrink_toward_the_mean_is_certified",
        "test_traced_radii_the_checks_refuse_are_never_certified",
        "test_vmapped_members_are_solved_as_if_alone",
        "test_warm_started_training_run_matches_cold_solves",
        "test_zero_radii_merge_clients_exactly",
    ),
    "test_projection_property.py": (
        "test_every_solver_matches_cvxpy_float32",
        "test_every_solver_matches_cvxpy_float64",
        "test_reported_odd_n_instances",
    ),
    "test_protocol.py": (
        "test_cross_validate_matches_a_hand_made_selection",
        "test_member_dissimilarities_match_one_call_per_member",
        "test_registry_builds_each_algorithm_with_its_rates_and_grid",
        "test_variant_rows_fedper_and_karula_at_the_theorem_step",
    ),
    "test_readme.py": ("test_readme_commands_and_example",),
    "test_step_size.py": (
        "test_coupling_of_projected_optima_is_the_solutions_connectivity",
        "test_default_is_stable_and_not_needlessly_small",
        "test_default_never_diverges_on_a_small_mlp",
        "test_init_picks_the_rule_from_the_loss_the_argument_or_an_estimate",
    ),
    "test_study.py": (
        "test_a_new_data_set_is_a_config_and_a_draw_function",
        "test_draw_study_lays_out_members_and_their_dissimilarities",
        "test_tuning_draws_choose_the_grid_and_the_seeds_train_final_fits",
    ),
    "test_theory.py": (
        "test_theorem_4_3_exact_gradients_every_k",
        "test_theorem_4_3_floor_grows_with_minibatch_noise",
        "test_theorem_4_3_floor_grows_with_the_projection_error",
        "test_theorem_4_3_proof_bound_within_ten_times_at_every_k",
    ),
    "test_theory_tight.py": ("test_one_round_exceeds_the_stated_constant_and_meets_the_proofs",),
    "test_training_batched.py": (
        "test_a_second_batch_of_one_factory_and_grid_compiles_no_chunk",
        "test_real_karula_resume_and_t_grid",
        "test_vmapped_seeds_and_grid_equal_separate_runs",
    ),
    "test_training_checkpoint.py": ("test_checkpoint_survives_a_kill_mid_write_and_run_cleans_up",),
    "test_training_diagnostics.py": (
        "test_real_karula_reports_unconverged_projection_and_fedavg_is_not_fedsgd",
    ),
}


def pytest_collection_modifyitems(items):
    """Marks ``slow`` every test of :data:`_SLOW_MODULES` and of :data:`SLOW_TESTS`."""
    for item in items:
        name = getattr(item, "originalname", item.name)
        if item.path.name in _SLOW_MODULES or name in SLOW_TESTS.get(item.path.name, ()):
            item.add_marker(pytest.mark.slow)
