"""Structured outputs inside the step (engine/structured_output/, the
sampler's constraints): with the builtin SmolLM2 tokenizer and random logits (no model), every
constrained row's tokens spell an instance of its grammar, unconstrained rows in the same batch
are left alone, and specs that cannot compile fail with xgrammar's reason."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from kvpilot.engine.model_loader import load_tokenizer
from kvpilot.engine.sample.sampler import Sampler
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.structured_output.backend_xgrammar import GrammarCompiler
from kvpilot.engine.structured_output.params import MAX_GRAMMAR_BYTES, MAX_JSON_NESTING, MAX_REPETITION
from kvpilot.engine.structured_output.params import StructuredOutputsParams as Spec

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


def run(sampler: Sampler, specs: dict[str, Spec | None], compiler, steps: int = 120, seed: int = 0):
    """Samples `steps` tokens per request from random logits (temperature 1, so the mask alone
    keeps a row in its grammar); returns each request's token ids, up to its first stop token."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(specs)
    params = [SamplingParams(temperature=1.0, max_tokens=steps, structured_outputs=s) for s in specs.values()]
    for rid, p in zip(ids, params):
        grammar = compiler.compile(p.structured_outputs) if p.structured_outputs else None
        sampler.add_request(rid, p, [], grammar)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(steps):
        logits = torch.randn(len(ids), VOCAB, generator=gen) * 3
        for rid, (token, _) in zip(ids, sampler(logits, ids, params)):
            out[rid].append(token)
    assert sampler.take_errors() == {}
    return {rid: toks[: toks.index(2)] if 2 in toks else toks for rid, toks in out.items()}


def test_constrained_rows_follow_their_grammars_and_free_rows_do_not(tokenizer, compiler):
    specs = {"schema": Spec(json=SCHEMA, disable_any_whitespace=True), "choice": Spec(choice=["yes", "no way"]),
             "regex": Spec(regex=r"[0-9]{3}-[a-z]{2}"), "grammar": Spec(grammar='root ::= "(" [a-c]+ ")"'),
             "free": None}
    tokens = run(Sampler(seed=0), specs, compiler)
    text = {rid: tokenizer.decode(t) for rid, t in tokens.items()}
    jsonschema.validate(json.loads(text["schema"]), SCHEMA)
    assert text["choice"] in ("yes", "no way")
    assert len(text["regex"]) == 6 and text["regex"][:3].isdigit() and text["regex"][3] == "-"
    assert text["grammar"][0] == "(" and text["grammar"][-1] == ")" and set(text["grammar"][1:-1]) <= set("abc")
    assert len(tokens["free"]) > 100  # random logits: no stop, and none of the others' tokens forced


def test_json_object_gives_json_and_a_finished_grammar_allows_only_the_stop_token(tokenizer, compiler):
    sampler = Sampler(seed=1)
    spec = Spec(json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
                disable_any_whitespace=True)
    grammar = compiler.compile(spec)
    params = SamplingParams(temperature=1.0, ignore_eos=True, structured_outputs=spec)
    sampler.add_request("r", params, [], grammar)
    gen = torch.Generator().manual_seed(3)
    tokens = [sampler(torch.randn(1, VOCAB, generator=gen) * 3, ["r"], [params])[0][0] for _ in range(20)]
    stop = tokens.index(2)
    assert json.loads(tokenizer.decode(tokens[:stop]))["ok"] in (True, False)
    assert set(tokens[stop:]) == {2}  # ignore_eos keeps going: only the stop token is allowed after the end


def test_allowed_token_ids_and_min_p_narrow_the_rows():
    sampler = Sampler(seed=0)
    allowed = [5, 17, 999]
    params = [SamplingParams(temperature=1.0, allowed_token_ids=allowed), SamplingParams(temperature=2.0, min_p=1.0)]
    for i, p in enumerate(params):
        sampler.add_request(str(i), p, [])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(2, 1000, generator=gen)
        (a, _), (b, _) = sampler(logits, ["0", "1"], params)
        assert a in allowed
        assert b == int(logits[1].argmax())  # min_p 1 keeps only the most likely token, at any temperature


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["a"]}, "exactly one of"), ({"choice": []}, "choice must"),
    ({"json": "[1]"}, "JSON schema object"), ({"json": "{"}, "not valid JSON"),
    ({"regex": "a" * (MAX_GRAMMAR_BYTES + 1)}, "at most"),
    ({"json": {"type": "string", "maxLength": 10**9}}, "repetition count of 1000000000"),
    ({"regex": "a{2,999999}"}, "repetition count of 999999"), ({"grammar": 'root ::= "a"{1000000}'}, "repetition"),
])
def test_malformed_specs_are_refused_before_compiling(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Spec(**kwargs)


@pytest.mark.parametrize("spec, reason", [
    (Spec(json={"type": "nonsense"}), "Unsupported type"), (Spec(regex="(("), "parenthesis"),
    (Spec(grammar="root ::= x"), "not defined"), (Spec(json={"$ref": "#/defs/x"}), "Cannot find"),
    (Spec(grammar="root ::= root"), "matches no output"),
])
def test_specs_that_cannot_compile_raise_value_error_with_xgrammars_reason(compiler, spec, reason):
    with pytest.raises(ValueError, match=reason):
        compiler.compile(spec)


def test_sampling_params_refuse_what_vllm_refuses():
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingParams(min_p=2.0)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])


def test_a_compile_past_its_timeout_is_a_400_and_leaves_the_caller_free(compiler):
    from kvpilot.engine.entrypoints.errors import APIError
    from kvpilot.engine.entrypoints.openai.structured_outputs import compile_spec

    slow = Spec(json={"type": "string", "maxLength": MAX_REPETITION})  # ~0.2 s to compile
    with pytest.raises(APIError) as caught:
        asyncio.run(compile_spec(lambda: compiler, slow, "response_format", timeout_s=0.005))
    assert caught.value.status == 400 and caught.value.param == "response_format"
    assert "did not compile within" in caught.value.message


def _nested_arrays(depth: int) -> dict:
    """A schema whose JSON nests objects and arrays `depth` levels: {"items": [{"items": ...}]} pairs."""
    schema: dict | list = {"type": "integer"}
    for _ in range(depth // 2):
        schema = {"type": "array", "prefixItems": [schema]}
    return schema


@pytest.mark.parametrize("depth, refused", [(MAX_JSON_NESTING - 2, False), (MAX_JSON_NESTING + 2, True),
                                            (1800, True)])
def test_json_schema_nesting_is_bounded_as_vllm_bounds_it(depth, refused):
    schema = _nested_arrays(depth)
    for given in (schema, json.dumps(schema) if depth < 900 else '{"a":' * depth + "1" + "}" * depth):
        if refused:
            with pytest.raises(ValueError, match=f"nest at most {MAX_JSON_NESTING} levels"):
                Spec(json=given)
        else:
            Spec(json=given)
