"""
Every exercise of the course, once. Three things read this list (and, to check them, the kit's own tests):

  - the graded tests: exercise N's tests carry the pytest marker `exN` (tests/conftest.py registers one
    marker per exercise, and pytest runs with --strict-markers, so a misspelt marker is an error);
  - the handout generator (handout.py): `regions` are the functions whose bodies it blanks; each is marked
    once in the source by a comment pair inside the body, `# BEGIN SOLUTION exN` ... `# END SOLUTION exN`;
  - the autograder (grade.py): it runs the tests of `test_file` selected by the marker, checks that exactly
    `tests` of them ran (a typo or an empty selection must not pass), and scales the passed share to `points`.

Every region is code the project runs: each is called when the methods that need it decode, on the eager and on
the static runtime, as EXERCISES.md's "Which methods run" table says (tests/test_course_runs.py checks both).
An exercise without regions is an open one, graded by hand (the autograder lists it and gives no points).
The tests of an exercise never need another exercise's blanked code (tests/test_course.py proves it on a
handout with every exercise blanked), so `prerequisites` is reading order, not a grading dependency.

`gates` are the tests that prove a law (an exact enumeration, a statistical bound) or, for a deterministic
function, pin its rules (the docstring's examples, each rule EXERCISES.md names, the comparison with a slow
oracle): if one of them fails, the exercise scores zero automatic points whatever its other tests say, since a
sampler with the wrong law, or a mask that lets a node see a cousin, is wrong however many cases it gets right. `reference` files hold a working copy of the exercise that
later exercises' tests use in its place (so exercise 4 is graded alone); a handout that blanks the exercise
leaves them out, and the grader of the full project brings them back (the impostor search, impostors.py, proves
that no function anywhere in a handout passes a blanked exercise; tests/test_course.py runs it).

Bump VERSION and add a line to EXERCISES.md's changelog whenever an exercise, its tests or its points change.
"""
from dataclasses import dataclass

VERSION = "1.10"


@dataclass(frozen=True)
class Exercise:
    id: int
    title: str
    regions: tuple  # ((file, function or Class.method), ...): the bodies the handout replaces
    test_file: str  # the graded tests, all marked exN
    tests: int  # how many tests the marker must select in test_file
    points: int
    prerequisites: tuple = ()  # exercises to read and do first
    gates: tuple = ()  # test functions (in test_file) that prove a law: one fails -> zero points
    reference: tuple = ()  # files with a working copy of this exercise, left out of handouts that blank it

    @property
    def marker(self):
        return f"ex{self.id}"

    @property
    def manual(self):
        return not self.regions


EXERCISES = (
    Exercise(1, "Prompt lookup: find the draft in the context",
             (("nanospec/decoding/prompt_lookup.py", "lookup"),),
             "tests/test_ex01_prompt_lookup.py", 10, 5,
             gates=("test_lookup_literal", "test_every_answer_is_a_copy_of_an_earlier_continuation")),
    Exercise(2, "Greedy verification of a chain of guesses",
             (("nanospec/rules/verify.py", "verify_chain_greedy"),),
             "tests/test_ex02_greedy_chain.py", 9, 5, (1,),
             gates=("test_literal", "test_docstring_example", "test_ties_go_to_the_first_maximum", "test_random_chains")),
    Exercise(3, "accept_prob and residual: one step that keeps the target's law",
             (("nanospec/rules/verify.py", "accept_prob"), ("nanospec/rules/verify.py", "residual")),
             "tests/test_ex03_accept_residual.py", 11, 8, (2,),
             gates=("test_the_output_law_is_p_exactly", "test_zero_mass_is_decided_row_by_row",
                    "test_the_output_law_is_p_when_sampled"),
             reference=("tests/reference_ex03.py",)),
    Exercise(4, "The chain rule and its bonus token",
             (("nanospec/rules/verify.py", "verify_chain"),),
             "tests/test_ex04_chain_rule.py", 10, 10, (2, 3),
             gates=("test_no_guesses_is_a_plain_sample_of_p", "test_a_rejection_draws_from_the_residual",
                    "test_all_accepted_then_the_bonus_follows_p_not_q", "test_accepted_count_is_truncated_geometric",
                    "test_generated_sequences_follow_the_target_law")),
    Exercise(5, "The KV cache: rollback and compaction",
             (("nanospec/model/cache.py", "KVCache.rollback"), ("nanospec/model/cache.py", "KVCache.compact")),
             "tests/test_ex05_kv_cache.py", 8, 8, (4,),
             gates=("test_rollback_when_the_lower_layers_ran_ahead", "test_compact_docstring_example", "test_chain_step_then_rollback_equals_recomputation", "test_tree_steps_then_compaction_equal_recomputation")),
    Exercise(6, "Tree attention: the mask and the position ids",
             (("nanospec/rules/tree.py", "tree_mask"), ("nanospec/rules/tree.py", "tree_positions")),
             "tests/test_ex06_tree_mask.py", 8, 8, (5,),
             gates=("test_docstring_example", "test_random_trees_agree_with_their_paths", "test_tree_forward_equals_a_plain_forward_along_each_path")),
    Exercise(7, "Medusa's tree from the heads' top-k",
             (("nanospec/rules/tree.py", "tree_from_paths"), ("nanospec/steps/tree_guesses.py", "medusa_tree")),
             "tests/test_ex07_medusa_tree.py", 9, 8, (6,),
             gates=("test_docstring_example", "test_nodes_by_depth_then_rank_and_duplicates_merged", "test_medusa_tree_docstring_example", "test_the_heads_fill_medusas_presets")),
    Exercise(8, "The tree rule: sample and descend",
             (("nanospec/rules/verify.py", "_descend"),),
             "tests/test_ex08_tree_rule.py", 8, 10, (4, 7),
             gates=("test_sampled_law_by_enumerating_every_draw", "test_sampled_law_through_verify_tree_descend",
                    "test_greedy_walks_on_random_trees")),
    Exercise(9, "EAGLE's dynamic tree, grown by confidence",
             (("nanospec/steps/eagle_tree.py", "grow_tree"), ("nanospec/steps/eagle_tree.py", "expand"),
              ("nanospec/rules/tree.py", "frontier_mask")),
             "tests/test_ex09_eagle_tree.py", 7, 12, (6, 8),
             gates=("test_a_deeper_tree_and_what_the_head_is_fed", "test_random_head_grows_the_slow_oracles_tree")),
    Exercise(10, "Lookahead: the Jacobi window and the n-gram pool in one tree",
             (("nanospec/decoding/lookahead.py", "remember"), ("nanospec/decoding/lookahead.py", "learn"),
              ("nanospec/decoding/lookahead.py", "build_tree")),
             "tests/test_ex10_lookahead.py", 8, 10, (6, 8),
             gates=("test_remember_keeps_the_newest_few_per_key", "test_learn_docstring_example", "test_build_tree_docstring_example", "test_every_window_node_sees_its_jacobi_trajectory")),
    Exercise(11, "ParallelSpec: the group-wise training mask",
             (("nanospec/model/drafters/parallelspec.py", "group_layout"),),
             "tests/test_ex11_parallelspec_mask.py", 7, 8, (6,),
             gates=("test_docstring_example", "test_a_group_does_not_see_the_text_after_its_anchor", "test_packed_training_logits_equal_inference_logits")),
    Exercise(12, "Open design: a drafter of your own, judged with make bench",
             (), None, 0, 8, (4, 8)),
    Exercise(13, "Recursive rejection over children drawn without replacement",
             (("nanospec/rules/verify.py", "without_replacement_proposals"),),
             "tests/test_ex13_without_replacement.py", 7, 10, (3, 8),
             gates=("test_the_node_law_is_p_by_enumeration", "test_a_drawn_tree_keeps_the_law_when_sampled")),
    Exercise(14, "Block verification: judge the whole chain at once",
             (("nanospec/rules/verify.py", "block_acceptance"),),
             "tests/test_ex14_block_verification.py", 8, 10, (3, 4),
             gates=("test_docstring_example", "test_the_papers_example_accepts_more_than_the_token_rule",
                    "test_the_law_is_the_targets_and_never_fewer_accepted",
                    "test_a_block_verified_loop_keeps_the_law_when_sampled")),
)

BY_ID = {ex.id: ex for ex in EXERCISES}


def parse_selection(text):
    """"3,4" or "1-4,7" or "all" -> the exercises, in id order. Unknown ids are a one-line ValueError."""
    if text is None or text.strip() in ("", "all"):
        return list(EXERCISES)
    ids = set()
    for part in text.split(","):
        part = part.strip()
        try:
            lo, _, hi = part.partition("-")
            lo, hi = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad exercise list {text!r}: use ids like 3,4 or 1-4 or all") from None
        if hi < lo:
            raise ValueError(f"bad exercise range {part!r} in {text!r}: write it low to high, {hi}-{lo}")
        ids.update(range(lo, hi + 1))
    unknown = sorted(ids - set(BY_ID))
    if unknown:
        raise ValueError(f"no exercise {', '.join(map(str, unknown))}: the exercises are 1..{len(EXERCISES)}")
    return [BY_ID[i] for i in sorted(ids)]
