"""SamplingParams validates itself once; each refusal names its field (``param``) and says whether the value
alone is out of range (``code`` "invalid_value") or clashes with another field (``code`` None)."""
import pytest

from paged_runtime.sampling_params import ParameterError, SamplingParams

OUT_OF_RANGE = [
    ({"n": 0}, "n"),
    ({"best_of": 0}, "best_of"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
]


@pytest.mark.parametrize("kwargs,param", OUT_OF_RANGE, ids=[f"{p}={list(k.values())[0]}" for k, p in OUT_OF_RANGE])
def test_out_of_range_values_name_their_field(kwargs, param):
    with pytest.raises(ParameterError) as info:
        SamplingParams(**kwargs)
    assert (info.value.param, info.value.code) == (param, "invalid_value")
    assert isinstance(info.value, ValueError) and str(info.value).startswith(param)


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
])
def test_clashing_fields_have_no_code(kwargs, param):
    with pytest.raises(ParameterError) as info:
        SamplingParams(**kwargs)
    assert (info.value.param, info.value.code) == (param, None)


def test_a_value_is_judged_before_its_clash_with_others():
    with pytest.raises(ParameterError) as info:
        SamplingParams(n=2, best_of=1, temperature=-1)
    assert info.value.param == "temperature"


def test_limits_themselves_are_accepted():
    params = SamplingParams(n=2, temperature=0, top_p=1, top_k=-1, min_p=1, presence_penalty=-2, frequency_penalty=2,
                            seed=2**64 - 1, logprobs=20, prompt_logprobs=0, min_tokens=16, max_tokens=16,
                            logit_bias={5: 250.0})
    assert params.top_k == 0 and params.best_of == 2
    assert params.logit_bias == {5: 100.0}  # clamped, not refused (the HTTP schema refuses beyond 100)
