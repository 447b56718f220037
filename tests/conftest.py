"""Shared test fixtures."""

from __future__ import annotations

import pytest

# (The root conftest.py turns the persistent compile cache off before logitloop is imported.)
from logitloop.decoding.runtime.compiles import CompileWatch


def _mapped_regions() -> tuple[int, int] | None:
    """(memory mappings this process has, the kernel's limit), where Linux says."""
    try:
        with open("/proc/self/maps") as f:
            count = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return count, int(f.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module", autouse=True)
def _bounded_executables():
    """After a test module, drop JAX's compiled programs once they hold half the process's
    memory mappings. Every XLA:CPU executable keeps 6-18 mappings (its JIT-compiled code;
    measured with jax 0.10.2) for as long as a jit cache holds it, and a worker that has
    run a few hundred tests holds thousands of executables; at `vm.max_map_count` (65530
    by default) a compile or a serialization cannot map memory. The likely cause of the
    two workers that died inside XLA:CPU late in a full run (not reproduced directly)."""
    yield
    regions = _mapped_regions()
    if regions is not None and regions[0] > regions[1] // 2:
        import jax

        jax.clear_caches()


@pytest.fixture
def compile_counter() -> CompileWatch:
    """`with compile_counter as c: ...; assert c.count == 0`."""
    return CompileWatch()


# Parametrized cases that cost the most and repeat what a cheaper case pins, moved to
# `-m slow` to keep the default suite under 15 minutes on 2 cores: greedy 32-token parity of
# the families whose logits parity (default) already covers every layer; the processor
# agreement test across generate/stream/generate_many (the mesh worker covers the loop).
SLOW_CASES = (
    # Repeats since packed scoring passes (issue 70): a deterministic pair beside wider pairs
    # and against generate over 100 tokens (tests/decoding/test_packed.py's alone-vs-packed
    # bits, float32 and bfloat16, and test_score.py's score = generate stay), and the
    # precompiled 24-call matrix (test_reuse.py's matrix after one warm-up, 4 programs, and
    # precompile's own cases stay).
    "tests/decoding/test_deterministic.py::test_score_row_alone_equals_row_beside_wider_pairs",
    "tests/decoding/test_compile_once.py::test_the_table_compiles_nothing_after_precompile",
    # The paged pool's and the prefix cache's costliest cases, each beside a default case of
    # the same path: speculation on a pool with preemptions (the 12-request paged job and
    # the speculative tests stay), eviction under a small pool (the deterministic prefix-cache
    # job stays), and prompt lookup over a copying model at 23 tokens (21, strict, stays).
    "tests/batching/test_paged_generate_many.py::test_speculative_paged_job_equals_the_contiguous_one",
    # A window layer's paged logits against its contiguous ring, model by model (issue 44's
    # layer groups: the Gemma job of tests/batching/test_layer_groups.py compares the same
    # through the loop, a paged local layer against the contiguous ring, and stays).
    "tests/models/test_paged_cache.py::test_paged_cache_logits_equal_the_contiguous_cache[False-5]",
    "tests/batching/test_prefix_cache.py::test_a_small_pool_evicts_and_keeps_results",
    "tests/decoding/test_speculative.py::test_prompt_lookup_accepts_every_draft_of_a_model_that_copies[23-strict]",
    "tests/decoding/test_speculative.py::test_prompt_lookup_accepts_every_draft_of_a_model_that_copies[23-rejection]",
    # Moved when the documentation's code blocks and the shared-prefix tests joined the
    # default suite (a fresh-clone run took 15 min 40 s): per-request draft counts, an
    # identical draft model (the draft-model catch-up test stays), the cost gate's second
    # case (the slowest-row case stays), a messages job resumed (the CLI's resume tests
    # stay), the CLI's stream against its batch text (test_cli_defaults' twin stays), and a
    # generate_many slot's bits against the row alone at 4 slots (the deterministic
    # prefix-cache job and the row-in-batch test stay; 32 slots was already here).
    "tests/decoding/test_speculative.py::test_generate_many_counts_drafts_per_request",
    "tests/decoding/test_speculative.py::test_identical_draft_model_accepts_every_greedy_draft",
    "tests/decoding/test_speculative.py::test_a_cycle_that_costs_more_than_the_row_gains_is_not_run",
    "tests/cli/test_chat_cli.py::test_messages_job_resumes",
    "tests/cli/test_cli.py::test_stream_prints_the_same_text",
    "tests/decoding/test_deterministic.py::test_generate_many_slot_equals_row_alone[4]",
    # Beam search against transformers on GPT-2 (the Llama case stays), and the CLI's
    # --num-beams against ll.beam_search (the score CLI's cases stay).
    "tests/decoding/test_beam.py::test_matches_transformers[gpt2]",
    "tests/cli/test_score_cli.py::test_generate_num_beams_is_beam_search",
    "tests/models/test_model_parity.py::test_greedy_32_tokens_match_hf_generate[gemma2]",
    "tests/models/test_model_parity.py::test_greedy_32_tokens_match_hf_generate[phi3]",
    "tests/models/test_model_parity.py::test_greedy_32_tokens_match_hf_generate[qwen3_moe]",
    "tests/models/test_model_parity.py::test_greedy_32_tokens_match_hf_generate[qwen2]",
    "tests/models/test_model_parity.py::test_greedy_32_tokens_match_hf_generate[llama3_rope]",
    "tests/models/test_phi3.py::test_decoding_across_the_switch_matches_hf_forward_with_a_cache",
    "tests/decoding/test_processors.py::test_generate_stream_and_generate_many_agree",
    # The pseudo-terminal sessions (a whole `logitloop chat` each), two speculative cases
    # that repeat strict-equals-plain on other entry points.
    "tests/cli/test_chat_cli.py::test_chat_on_a_terminal",
    "tests/cli/test_chat_cli.py::test_ctrl_c_ends_a_reply_not_the_chat",
    "tests/decoding/test_speculative.py::test_stream_and_generate_many_take_the_same_tokens",
    "tests/decoding/test_speculative.py::test_strict_rejection_and_plain_coincide_on_greedy_rows",
    # The hypothesis stop-string property (30 s; the table-driven stop-string cases stay).
    # Twice in the full suite the worker running it died inside XLA:CPU, late in the
    # worker's life, most likely out of memory mappings (see `_bounded_executables`).
    "tests/decoding/test_stop_strings.py::test_device_detection_matches_host_reference",
    # Repeats of what cheaper default cases pin: the large-vocabulary draw statistics, the
    # draft-model chi-square (prompt lookup's stays), a second prefill chunk size, two
    # processes against one (the meshes stay).
    "tests/decoding/test_sampler_distribution.py::test_draws_follow_the_reference_distribution[large_vocabulary]",
    "tests/decoding/test_speculative.py::test_rejection_matches_plain_sampling_distribution[draft_model]",
    "tests/decoding/test_deterministic.py::test_chunked_prefill_equals_one_pass[5]",
    "tests/sharding/test_multiprocess.py::test_two_processes_agree_with_single_process",
    # The deterministic matrix's costliest default cases (~30 s and ~25 s): the grouped-query
    # Llama in a batch of 64 (the shipped model's batch of 17 stays, and the same Llama stays
    # in generate_many, speculation and chunked prefill), and 32 slots (4 stay).
    "tests/decoding/test_deterministic.py::test_row_alone_equals_row_in_batch[gqa_llama-512-3-64]",
    "tests/decoding/test_deterministic.py::test_generate_many_slot_equals_row_alone[32]",
    # Two more ~20-s cases whose property a cheaper default case pins as well: a float32
    # Llama's generate_many rows against generate (the scripted slot-reuse identity and the
    # deterministic 4-slot case stay), and a deterministic row under speculation (strict
    # speculation's equality with generate stays).
    "tests/batching/test_generate_many.py::test_llama_identity_float32",
    "tests/decoding/test_deterministic.py::test_speculative_row_equals_the_row_alone",
    # Made room for the shared-prefix (cascade) decode attention's tests (the float32 run in
    # the n = 16 test and the op's float64 cases): a forked row against its parent at the
    # layer level (the n = 16 test forks and copies the partial page end to end, bit for
    # bit and in float32), the reference's multi-head shape (grouped-query, multi-query and
    # 16-token pages stay; the kernel's tests run the multi-head shape) and one middle case
    # of the XLA path's table prefix (3, 16, 17 and 64 stay).
    "tests/models/test_paged_cache.py::test_a_forked_row_continues_as_its_parent",
    "tests/ops/test_paged_attention.py::test_reference_matches_float64[mha-",
    "tests/ops/test_paged_attention.py::test_xla_path_reads_a_prefix_of_the_table[40]",
    # On the AMD EPYC machines the suite took 21 minutes (2026-12-04; 10-11 on the Intel
    # Xeon ones), so these ~650 s of cases (as measured in the full suite there, where two
    # workers share the two cores) went to `-m slow` as well, each a repeat of what a
    # default case pins:
    # - the CLI's --stream --stop (the library's table holds it; the CLI's --stream stays);
    #   8 of the 14 one-line CLI errors (6 stay, with the library's validation tests); the
    #   /dev/stdout output ("-" stays);
    "tests/cli/test_cli.py::test_stream_with_stop_prints_the_plain_text",
    *(
        f"tests/cli/test_cli.py::test_bad_input_is_one_line_and_status_2[{case}]"
        for case in (
            "line-knob",
            "model",
            "too-long",
            "input-file",
            "surrogate-in-jsonl",
            "string-max-tokens",
            "duplicate-id",
            "jsonl",
        )
    ),
    "tests/cli/test_cli.py::test_output_to_stdout[/dev/stdout]",
    # - the chat CLI's generation defaults and template stop (the library's
    #   `tests/chat/test_chat.py` holds both; the CLI's end-of-turn reply stays);
    "tests/cli/test_chat_cli.py::test_generation_defaults_are_used_and_shown",
    "tests/cli/test_chat_cli.py::test_messages_stop_at_the_template_s_end_of_turn",
    # - the model-parallel mode's batch case (its unit tests of the split product stay; its
    #   mesh cases were slow already), the float32 shipped model's logits in the mode (the
    #   Llama's stay), and the wider of the two attention shapes;
    "tests/decoding/test_deterministic.py::test_model_parallel_mode_row_alone_equals_row_in_batch",
    "tests/decoding/test_deterministic.py::test_deterministic_logits_are_the_models[shipped_f32]",
    "tests/decoding/test_deterministic.py::"
    "test_fixed_order_attention_ignores_batch_columns_and_cache_length[2-4-64]",
    # - the sampler's float16 and large-vocabulary reference cases (bfloat16, and the
    #   sampler's large-vocabulary statistics in `test_sampler_distribution`, stay);
    *(
        f"tests/decoding/test_sampler_reference.py::test_{name}_reference[{case}]"
        for name in ("kept_set_matches", "probabilities_match")
        for case in ("float16", "large_vocabulary")
    ),
    # - three stop-string table rows whose shape another row has (a 2-token span, the
    #   repeated prefix over one token, a stop that never matches);
    *(f"tests/decoding/test_stop_strings.py::test_stop_string_cases[seq{i}-" for i in (2, 3, 8)),
    # - prompt lookup's every-draft case in rejection mode at the shorter period (both
    #   modes at the longer one stay), and the processors' explain stage (explain's own
    #   tests stay);
    "tests/decoding/test_speculative.py::"
    "test_prompt_lookup_accepts_every_draft_of_a_model_that_copies[21-rejection]",
    "tests/decoding/test_processors.py::test_explain_shows_the_processors_stage",
    # - the float16 reference cases of the sampler's other checks (bfloat16 stays), the
    #   top-p = 1 / min-p = 0 identity property (the reference tests pin both knobs),
    #   prompt lookup's strict every-draft case at the shorter period, and the explain
    #   CLI's table and plot (the library's explain tests and the CLI's flags stay);
    *(
        f"tests/decoding/test_sampler_reference.py::test_{name}[float16]"
        for name in (
            "status_is_ok_for_sampleable_rows",
            "drawn_tokens_lie_in_the_kept_set",
            "greedy_rows_return_the_reference_argmax",
            "logprobs_are_the_log_of_the_reference_probability",
            "raw_logprobs_match_float64_log_softmax",
            "top_logprobs_match_the_reference_top_n",
        )
    ),
    "tests/decoding/test_sampler_properties.py::test_top_p_one_and_min_p_zero_are_exact_identities",
    "tests/decoding/test_speculative.py::"
    "test_prompt_lookup_accepts_every_draft_of_a_model_that_copies[21-strict]",
    "tests/cli/test_explain.py::test_table",
    "tests/cli/test_explain.py::test_plot",
    # - the training script's runs (about a minute and a half of training; the shipped
    #   model's checkpoints and Orbax's round trip are tested by default).
    "tests/scripts/test_train_tiny.py",
    # The fourth wave's tests (lm-eval, Ray, RL, quantization) took the suite to 17.5 min,
    # so these went to `-m slow`, each pinned by a default case beside it: the 20011-token
    # vocabulary of the unscaled-temperature identity (3001 stays), the plain Llama through
    # blockwise attention (Gemma 2's windows and soft-capping stay), the TPU kernel's
    # small-head lowering without a window (the 128-wide windowed one and the no-kernel
    # fallback stay) and its plain interpret case (the windowed, soft-capped one stays).
    "tests/ops/test_candidates.py::test_unscaled_logits_with_temperature_equal_scaled_logits[20011]",
    "tests/ops/test_attention.py::test_models_through_blockwise_equal_the_reference[llama]",
    "tests/ops/test_attention_tpu.py::test_a_prompt_pass_lowers_to_the_kernel_for_tpu[8-None-True]",
    "tests/ops/test_attention_tpu.py::test_splash_in_interpret_mode_matches_float64[40-None-None-True]",
    # Session 6's fresh-clone run took 18 min 21 s: the CLI's killed-and-resumed job (the
    # resumed-job equality and the score CLI's resume stay), and the tied quantized
    # tables' whole-model check (the lookup and head against float64 stay, and the
    # quantized model's logits against its dequantized twin).
    "tests/cli/test_cli.py::test_resume_after_kill_matches_clean_run",
    "tests/models/test_quantized_embedding.py::"
    "test_model_with_quantized_tables_equals_dequantized_float_tables[tied]",
    # The sixth wave's fresh-clone run took 19 min 17 s (reuse before compiling, the store
    # of executables, Hub names, LoRA), before guidance, watermarks and capture joined.
    # Each of these repeats what a default case beside it pins:
    # - the compile report's wording and the prepared model's warning, and a padded
    #   batch's rows (the table that compiles nothing stays); the first deterministic
    #   generate's program count (the row-in-batch bits stay);
    "tests/decoding/test_compile_once.py::"
    "test_compile_stats_name_what_was_new_and_a_prepared_model_warns",
    "tests/decoding/test_compile_once.py::test_a_padded_batch_gives_each_row_its_own_tokens",
    "tests/decoding/test_probe_record.py::"
    "test_the_first_deterministic_generate_compiles_a_handful_of_programs",
    # - a second process of the lm-eval backend (the store's second process stays), the
    #   CLI's Ray job through a local cluster (the actor's rows in process stay), the score
    #   CLI's resume (the generate CLI's resume stays);
    "tests/integrations/test_lm_eval.py::test_a_second_process_compiles_nothing_the_first_compiled",
    "tests/integrations/test_ray.py::test_cli_ray_job_equals_single_process_generate_many",
    "tests/cli/test_score_cli.py::test_score_writes_lines_in_order_and_resumes",
    # - LoRA's n > 1 and stream, own model, beam search and token_logprobs cases (the mixed
    #   batch against PEFT, the deterministic bits, generate_many's prefix cache, score and
    #   the CLI stay);
    "tests/lora/test_lora.py::test_n_rows_and_stream_take_the_prompts_adapter",
    "tests/lora/test_lora.py::test_own_model_gets_adapters_through_ll_dense",
    "tests/lora/test_lora.py::test_beam_search_under_adapters_equals_transformers_on_the_merged_models",
    "tests/lora/test_lora.py::test_token_logprobs_under_adapters_equal_the_rollout",
    # - one beam against greedy generate (beam search against transformers stays), a
    #   draft model catching up (its rows switching off stays), strict speculation's
    #   processor states and the cost gate's slowest row (strict speculation's tokens
    #   against generate stay), n and logprobs added mid job (stop strings added mid job
    #   stay), an own model's pool with the prefix cache and its other entry points (its n
    #   rows sharing pages stay), batches and progress in scoring (shared prompts stay), a
    #   row's token from its own inputs (the per-row reference tests stay).
    "tests/decoding/test_beam.py::test_one_beam_is_greedy_generate[llama]",
    "tests/decoding/test_speculative.py::test_draft_model_catches_up_after_plain_steps",
    "tests/decoding/test_speculative.py::test_strict_keeps_processor_states_to_the_accepted_tokens",
    "tests/decoding/test_speculative.py::test_the_slowest_row_decides_whether_a_cycle_runs",
    "tests/batching/test_generate_many.py::test_n_samples_and_logprobs_added_mid_job",
    "tests/models/test_own_model.py::test_paged_pool_with_prefix_cache_equals_contiguous_generate",
    "tests/models/test_own_model.py::test_stream_beam_search_token_logprobs_and_precompile_take_it",
    "tests/decoding/test_score.py::test_batches_and_progress_do_not_change_scores",
    "tests/decoding/test_sampler_properties.py::test_a_rows_token_depends_only_on_its_own_inputs",
    # The run after those took 18 min 42 s (1508 passed): a Ray actor's job bounds (the
    # actor's compile-cache tests stay), the CLI's second run reading the cache (the store's
    # second process stays), stream's text against generate's (stream's stop-string
    # concatenation cases stay), a constant added to a row (the sampler's reference cases
    # stay), explain's logits against generate's (explain's other cases stay), a long
    # cache's generate against the full forward (every prefix against the full product, in
    # tests/models/test_attention.py, stays).
    "tests/integrations/test_ray_actor_cache.py::"
    "test_an_actor_given_the_job_bounds_compiles_at_start_and_never_after",
    "tests/cli/test_compile_cache.py::test_a_run_fills_the_cache_and_a_second_reads_it",
    "tests/decoding/test_stream_text.py::test_stream_concatenates_to_generate_text",
    "tests/decoding/test_sampler_properties.py::test_adding_a_constant_to_a_row_changes_nothing",
    "tests/decoding/test_explain.py::test_logits_are_what_generate_sees",
    "tests/decoding/test_prefix_attention.py::test_long_cache_generate_equals_full_cache_forward",
    # Ray rows' guidance and steering columns against generate (the CLI JSONL job's lines,
    # built into requests by the same `jobs.request_keys`, stay; so do Ray's cell parsing).
    "tests/integrations/test_ray.py::test_guidance_and_steering_columns_equal_generate",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid.startswith(case) for case in SLOW_CASES):
            item.add_marker(pytest.mark.slow)


_MODULE_FIXTURE = ('scope="module"', 'scope="class"')


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (xdist's default `--dist load`) with one change: every test of a module that
    defines a module- or class-scoped fixture goes to the same worker, and so do the code
    blocks of README.md and docs/. Plain `load` spreads a module's tests over both workers,
    so each worker paid for the module's fixtures (the 8-device mesh subprocess, the CLI's
    batch job, a training run: about a minute each) and compiled the module's programs
    again. Such modules are sent first, biggest first
    (xdist's `loadscope` order); the other tests, one by one, fill in behind them.
    (`--dist loadgroup` would do this with marks, but with pytest 9 its group suffix on
    the node ids has no effect: measured, the marked tests were spread.) Any other
    `--dist` keeps xdist's own scheduler."""
    if config.getoption("dist", None) != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath
    shares_fixtures: dict[str, bool] = {}

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.endswith(".md"):  # the documentation's blocks share one model and its
                return "docs"  # compiled programs (conftest.py), so they go to one worker
            if path not in shares_fixtures:
                try:
                    text = (root / path).read_text()
                except OSError:
                    text = ""
                shares_fixtures[path] = any(s in text for s in _MODULE_FIXTURE)
            return path if shares_fixtures[path] else nodeid

    return ModuleFixtureScheduling(config, log)
