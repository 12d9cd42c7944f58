"""Options come from init() arguments over TRAINGUARD_* variables; problems are reported, never raised."""

from __future__ import annotations

from trainguard.options import Options, build_options


def test_environment_values_are_coerced_to_the_option_type() -> None:
    env = {"TRAINGUARD_ENDPOINT": "http://x:1", "TRAINGUARD_MAX_QUEUE_EVENTS": "77",
           "TRAINGUARD_FLUSH_INTERVAL": "0.25", "TRAINGUARD_CAPTURE_EXIT": "false",
           "TRAINGUARD_LOG_LOGGERS": "a, b", "TRAINGUARD_TAGS": "team=nlp,size=7b"}
    opts, problems = build_options({}, env)
    assert problems == []
    assert (opts.endpoint, opts.max_queue_events, opts.flush_interval, opts.capture_exit) == (
        "http://x:1", 77, 0.25, False)
    assert opts.log_loggers == ["a", "b"]
    assert opts.tags == {"team": "nlp", "size": "7b"}


def test_explicit_arguments_win_and_none_means_default() -> None:
    env = {"TRAINGUARD_PROJECT": "from-env", "TRAINGUARD_ENDPOINT": "http://env:1"}
    opts, _ = build_options({"project": "explicit", "endpoint": None, "token": None}, env)
    assert opts.project == "explicit"
    assert opts.endpoint == "http://env:1"  # endpoint=None falls back to the environment
    assert opts.token is None


def test_problems_are_reported_not_raised() -> None:
    opts, problems = build_options({"no_such_option": 1, "tags": "not-a-dict", "max_batch_events": 0},
                                   {"TRAINGUARD_MAX_QUEUE_EVENTS": "many"})
    assert "unknown option 'no_such_option' ignored" in problems
    assert any("TRAINGUARD_MAX_QUEUE_EVENTS" in p for p in problems)
    assert any("tags must be a mapping" in p for p in problems)
    assert any("max_batch_events must be >= 1" in p for p in problems)
    assert opts.max_queue_events == Options().max_queue_events
    assert opts.max_batch_events == Options().max_batch_events


def test_unserialisable_tags_are_stringified() -> None:
    class Weird:
        def __str__(self) -> str:
            return "weird!"

    opts, problems = build_options({"tags": {"obj": Weird(), 3: [1, 2]}}, {})
    assert problems == []
    assert opts.tags == {"obj": "weird!", "3": "[1, 2]"}


def test_a_misspelt_variable_names_the_option_meant() -> None:
    # the case: a typo'd TRAINGUARD_ENDPIONT silently left the SDK disabled
    opts, problems = build_options({}, {"TRAINGUARD_ENDPIONT": "http://x:1", "TRAINGUARD_RUNNAME": "r",
                                        "TRAINGUARD_TOKEN": "t", "TRAINGUARD_COLOUR": "blue"})
    assert opts.endpoint is None
    assert problems == [
        "TRAINGUARD_ENDPIONT is not a TrainGuard setting (ignored): did you mean TRAINGUARD_ENDPOINT?",
        "TRAINGUARD_RUNNAME is not a TrainGuard setting (ignored): did you mean TRAINGUARD_RUN_NAME?",
    ]


def test_no_server_or_agent_variable_is_called_a_typo() -> None:
    # a job's environment often carries the backend's settings too (compose files, pods): they are no typos
    from trainguard_server.config import Settings

    env = {f"TRAINGUARD_{name.upper()}": "1" for name in Settings.model_fields}
    env.update({"TRAINGUARD_READ_TOKEN": "r", "TRAINGUARD_AGENT_UPSTREAM": "http://x:1"})
    assert len(env) > 50
    assert build_options({}, env)[1] == []
