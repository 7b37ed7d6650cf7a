"""StepObserver: step counts, the step log and the pacer's feed (no model)."""

from worker.executor import PendingStep
from worker.request import Request, ScheduledTask
from worker.sampling import SamplingParams
from worker.scheduler import PromptPacer
from worker.stats import StepObserver


def _step(*tasks: tuple[Request, int], overlapped: bool = False) -> PendingStep:
    scheduled = [ScheduledTask(r, n) for r, n in tasks]
    return PendingStep(scheduled, list(range(len(scheduled))), overlapped=overlapped)


def _request(rid: str, prompt: int, outputs: int = 0) -> Request:
    r = Request(rid, list(range(prompt)), SamplingParams())
    r.output_ids = [1] * outputs
    r.num_computed = r.num_tokens - 1 if outputs else 0
    return r


def test_a_step_is_classified_at_launch_though_its_requests_advance_before_it_resolves():
    observer = StepObserver(pacer=None)
    observer.step_log = []
    decoding, prompt = _request("d", 5, outputs=2), _request("p", 7)
    step = _step((decoding, 1), (prompt, 7), overlapped=True)
    observer.launched(step)
    prompt.output_ids.append(-1)  # an overlapped successor advanced it meanwhile
    observer.resolved(step, started=0.0)
    (record,) = observer.step_log
    assert (record.num_decodes, record.num_prompt_tokens, record.overlapped) == (1, 7, True)
    assert record.seconds > 0
    assert observer.num_steps == observer.num_overlapped_steps == 1


def test_without_a_pacer_or_a_log_steps_are_only_counted():
    observer = StepObserver(pacer=None)
    step = _step((_request("d", 3, outputs=1), 1))
    observer.launched(step)
    observer.resolved(step, started=0.0)
    assert observer.num_steps == 1 and observer.step_log is None and step.num_decodes == 0


def test_the_pacer_learns_from_each_resolved_step():
    pacer = PromptPacer(slowdown=2.0)
    observer = StepObserver(pacer)
    for prompt_tokens in (0, 0, 8, 16):
        tasks = [(_request("d", 3, outputs=1), 1)]
        if prompt_tokens:
            tasks.append((_request("p", prompt_tokens), prompt_tokens))
        step = _step(*tasks)
        observer.launched(step)
        observer.resolved(step, started=0.0)
    assert pacer.decode_step_s(1) is not None and pacer.prompt_cost() is not None
