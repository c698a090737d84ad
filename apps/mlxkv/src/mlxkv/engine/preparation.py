"""A request as the worker runs it: the prompt built and tokenized, max_tokens clamped to the
context, sampling, grammar and speculation over the server's defaults, and the request key."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlxkv_inference import GenerationParams, Grammar, SamplingParams, compile_grammar
from mlxkv_inference.speculative.speculation import SpeculativeParams
from mlxkv_inference.tokenizer.chat import encode_chat, template_takes_tools
from mlxkv_inference.tokenizer.protocol import Tokenizer
from mlxkv_serve import GenerateRequest, PromptTooLongError, Speculation
from mlxkv_ssd_cache import KvIdentity

from mlxkv.engine.checkpoints import request_key
from mlxkv.engine.harmony import harmony_answer_grammar
from mlxkv.engine.reasoning import ThinkStart, starts_thinking, think_tags
from mlxkv.engine.thinking import think_plan
from mlxkv.engine.tool_calls import ToolUse, chat_messages, constrained_grammar, template_tools, think_grammar, tool_use
from mlxkv.engine.tool_formats import model_tool_format


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt: list[int]
    history_end: int | None  # where the chat's history ends in `prompt` (None: not a chat)
    params: GenerationParams
    key: str  # the request key its checkpoints are kept under
    tools: ToolUse
    think: ThinkStart  # where the answer starts as to a think section (the worker's stream splits it out)


class RequestPreparer:
    def __init__(self, tokenizer: Tokenizer, identity: KvIdentity, context_length: int, base_params: GenerationParams,
                 has_draft: bool) -> None:
        """`base_params` gives what a request does not; `has_draft`: whether the server has a
        draft model (speculative mode "draft")."""
        self._tokenizer = tokenizer
        self._identity = identity
        self.context_length = context_length
        self.base_params = base_params
        self._has_draft = has_draft
        self._think = think_tags(tokenizer)  # None: the model does not think
        self._tool_format = model_tool_format(tokenizer)  # its family's call format

    def tools(self, request: GenerateRequest) -> ToolUse:
        return tool_use(request, self._tool_format)

    def prepare(self, request: GenerateRequest, ns: str = "") -> Prepared:
        """The request as the worker runs it; raises what `submit` documents for a bad one."""
        tools = self.tools(request)
        prompt, history_end = self.encode(request, tools)
        if len(prompt) >= self.context_length:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens; the model's context is {self.context_length} "
                                     "tokens (the prompt must leave room for at least one token of answer)")
        # Agents ask for more than any local context holds (Claude Code: 32,000 or 128,000): the
        # answer gets what fits, and says "length" if it runs out, instead of a refusal.
        max_tokens = min(request.max_tokens, self.context_length - len(prompt))
        s = request.sampling
        sampling = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logit_bias=dict(s.logit_bias), seed=s.seed,
        )
        grammar = self._answer_grammar(request, tools, prompt, max_tokens)
        if grammar is not None:
            compile_grammar(grammar, self._tokenizer)  # a grammar that does not compile is the caller's 400
        params = replace(self.base_params, max_tokens=max_tokens, sampling=sampling, stop=request.stop, grammar=grammar,
                         speculative=self._speculation(request.speculative))
        return Prepared(prompt, history_end, params, request_key(self._identity, ns, prompt, params, request.top_logprobs), tools,
                        self._think_start(request, prompt))

    def encode(self, request: GenerateRequest, tools: ToolUse) -> tuple[list[int], int | None]:
        """(prompt tokens, where the chat's history ends in them)."""
        tokenizer = self._tokenizer
        if request.messages is not None:
            native = template_takes_tools(tokenizer)
            messages = chat_messages(request.messages, tools.tools, native, tools.format)
            chat = encode_chat(tokenizer, messages, template_tools(tools.tools) if native and tools.tools else None,
                               request.answer_start, request.enable_thinking, request.reasoning_effort)
            return chat.tokens, chat.history_end
        if request.prompt is not None:
            return tokenizer.encode(request.prompt), None
        assert request.prompt_tokens is not None
        bad = [t for t in request.prompt_tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {tokenizer.vocab_size})")
        return list(request.prompt_tokens), None

    def _answer_grammar(self, request: GenerateRequest, tools: ToolUse, prompt: list[int], max_tokens: int) -> Grammar | None:
        """Text or tool calls (after a think section), else the request's constraint, else a think
        section bounded by its budget (thinking turned off: closed at once)."""
        budget = 0 if request.enable_thinking is False else request.thinking_budget
        if tools.format.name == "harmony" and request.messages is not None:  # channels, not think tags
            return harmony_answer_grammar(tools.callable, tools.required, request.constraint, budget, tools.format.literal)
        plan = think_plan(self._think, prompt, budget) if request.messages is not None else None
        if tools.active:
            return tools.grammar(plan)
        if request.constraint is not None:  # after a think section bounded by its budget
            return constrained_grammar(request.constraint, plan if plan is not None and plan.budget is not None else None)
        return think_grammar(plan) if plan is not None and plan.budget is not None and plan.budget < max_tokens else None

    def _think_start(self, request: GenerateRequest, prompt: list[int]) -> ThinkStart:
        if request.messages is None or self._think is None:
            return "none"
        return "inside" if starts_thinking(self._think, prompt) else "may_open"

    def _speculation(self, asked: Speculation) -> SpeculativeParams:
        """The request's `speculative` field over the server's defaults (a 400 when it asks for a
        draft model the server has none of)."""
        default = self.base_params.speculative
        mode = asked.mode or default.mode
        if mode == "draft" and not self._has_draft:
            raise ValueError("speculative mode 'draft' needs a draft model; start the server with --draft-model or --draft-layers")
        return replace(default, mode=mode, num_draft_tokens=asked.num_draft_tokens or default.num_draft_tokens)
