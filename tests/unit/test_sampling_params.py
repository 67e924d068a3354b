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
    ({"logprobs": -1}, "logprobs"),
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


NAN, INF = float("nan"), float("inf")
NOT_FINITE = [
    ({"temperature": INF}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": 1e39}, "temperature"),  # finite in Python, inf in the sampler's float32
    ({"top_p": NAN}, "top_p"),
    ({"min_p": NAN}, "min_p"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"frequency_penalty": INF}, "frequency_penalty"),
    ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"repetition_penalty": 1e-46}, "repetition_penalty"),  # 0 in float32: logits / 0
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),  # subnormal: a positive logit / it is inf
    ({"logit_bias": {5: NAN}}, "logit_bias"),
    ({"logit_bias": {5: INF}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"n": 2.5}, "n"),
    ({"top_k": INF}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 2.0}, "max_tokens"),
]


@pytest.mark.parametrize("kwargs,param", NOT_FINITE, ids=[f"{p}={list(k.values())[0]}" for k, p in NOT_FINITE])
def test_nan_inf_and_non_integers_are_refused_by_name(kwargs, param):
    with pytest.raises(ParameterError) as info:
        SamplingParams(**kwargs)
    assert (info.value.param, info.value.code) == (param, "invalid_value")


def test_huge_top_k_and_extreme_seed_are_accepted_here():
    # top_k beyond the vocabulary means "no filter" (the engine knows the vocabulary); any seed torch takes.
    assert SamplingParams(top_k=2**70).top_k == 2**70
    assert SamplingParams(n=4, seed=2**64 - 1).seed == 2**64 - 1


def test_sibling_seeds_never_leave_torchs_seed_range():
    from paged_runtime.sampling_params import SEED_MAX, sequence_seed
    assert sequence_seed(7, 0) == 7 and sequence_seed(7, 3) == 10  # unchanged where nothing overflows
    assert sequence_seed(SEED_MAX, 1) == 0 and sequence_seed(SEED_MAX - 1, 3) == 1  # wraps as torch does
    assert sequence_seed(-1, 0) == -1 and sequence_seed(-1, 1) == 0  # torch reads -1 as 2**64 - 1


def test_delta_output_needs_best_of_equal_to_n():
    from paged_runtime.sampling_params import RequestOutputKind
    with pytest.raises(ParameterError) as info:
        SamplingParams(n=1, best_of=2, output_kind=RequestOutputKind.DELTA)
    assert (info.value.param, info.value.code) == ("best_of", None)
    assert SamplingParams(n=2, output_kind=RequestOutputKind.DELTA).best_of == 2
