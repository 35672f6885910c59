"""Jinja's immutable sandbox for chat templates, with bounds on work, output, loop size, nesting and time.

A chat template is code written by whoever made the model file (a GGUF's metadata, a tokenizer
config) or, with ``--trust-request-chat-template``, by a client. Jinja's
``ImmutableSandboxedEnvironment`` keeps it away from Python's internals and from mutating data,
but not from running long or allocating without limit: ``range(10**9)``, ``'a' * 10**10``, a
string doubled in a loop, runaway macro recursion. This module adds those bounds:

* work: every value the template builds (a string, list, dict, number, an output) is charged
  its size, and every loop step and call a fixed cost, against ``RenderLimits.max_work``. A
  size counts shared parts each time they are referenced, so ``[x, x]`` costs twice ``x`` and a
  value doubled forty times is refused long before anything prints, compares or hashes it.
  Operations that can multiply a size (``*``, ``**``, ``%``, ``str.format``, ``replace``,
  ``join``, padding, ``indent``...) are estimated and refused *before* they allocate.
* a deadline, checked at every hook: attribute and item access, calls, operators, filters,
  tests and loop steps;
* ``range()`` up to ``max_range`` items, call nesting up to ``max_call_depth``, output up to
  ``max_output_chars``, integers up to ``max_int_bits``, the template's source up to
  ``max_template_chars`` (compiling it cannot be interrupted).

The hooks are the sandbox's own (``call``, ``getattr``, ``getitem``, ``call_binop``), wrappers
around every filter and test, and a code generator that routes ``~``, list/tuple/dict displays
and for-loop iterables through the environment. Anything that goes wrong is a
:class:`ChatTemplateError` whose message starts with the request field to blame.
"""

from __future__ import annotations

import functools
import json
import re
import string
import types
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from kiln.entrypoints.chat_template_budget import (
    ACTIVE_BUDGET,
    CALL_COST,
    DEFAULT_LIMITS,
    INPUT_WORK,
    Budget,
    Guarded,
    RenderLimits,
    TemplateBoundError,
    active_budget,
)


class ChatTemplateError(ValueError):
    """A chat template that could not render: its own error, a syntax error, or a bound exceeded.

    ``param`` is the request field to blame: ``chat_template`` for the template itself,
    ``messages`` for what the template refused about the conversation.
    """

    def __init__(self, message: str, param: str = "chat_template") -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


# --------------------------------------------------------------------------- size estimates
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*|\*)(?:\.(\d*|\*))?")


def _ints(values: Any) -> list[int]:
    return [abs(v) for v in values if isinstance(v, int)]


def _fields_estimate(budget: Budget, fmt: str, fields: int, widths: list[int], values: list[Any]) -> int:
    """A format with ``fields`` conversions: each may print the largest value, padded to any width given."""
    largest = max((budget.size(v) for v in values), default=0)
    width = max(widths + _ints(values), default=0)
    return len(fmt) + fields * (2 * largest + width)


def _printf_estimate(budget: Budget, fmt: Any, args: Any) -> int:
    if not isinstance(fmt, (str, bytes)):
        return 0
    text = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) else [args]
    widths = [int(d) for spec in _PRINTF_SPEC.findall(text) for d in spec if d.isdigit()]
    return _fields_estimate(budget, text, text.count("%"), widths, values)


def _format_estimate(budget: Budget, fmt: str, values: list[Any]) -> int:
    fields, widths = 0, []
    for _text, name, spec, _conversion in string.Formatter().parse(fmt):
        if name is not None:
            fields += 1
            widths += [int(d) for d in re.findall(r"\d+", spec or "")]
    return _fields_estimate(budget, fmt, fields, widths, values)


def _replace_estimate(budget: Budget, text: Any, old: Any, new: Any) -> int:
    if not (isinstance(text, str) and isinstance(old, str)):
        return budget.size(text) * (1 + budget.size(new))
    return len(text) + text.count(old) * len(str(new))


def _binop_estimate(budget: Budget, op: str, left: Any, right: Any) -> int:
    sequence = (str, bytes, list, tuple)
    if op == "+" and isinstance(left, sequence) and isinstance(right, sequence):
        return budget.size(left) + budget.size(right)
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, sequence) and isinstance(times, int):
                return budget.size(seq) * max(times, 0)
        if isinstance(left, int) and isinstance(right, int):
            _int_bits(budget, left.bit_length() + right.bit_length())
    if op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _int_bits(budget, right * left.bit_length())
    if op == "%":
        return _printf_estimate(budget, left, right)
    return 0


def _int_bits(budget: Budget, bits: int) -> None:
    if bits > budget.limits.max_int_bits:
        budget.trip(f"an integer of about {bits} bits is over the limit of {budget.limits.max_int_bits}")


def _method_call(budget: Budget, method: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    """The size a builtin method's result could reach, and its arguments (``join`` reads its items first).

    Any integer argument counts as a size the result may reach (``ljust``, ``zfill``, ``to_bytes``...).
    """
    owner, name = method.__self__, method.__name__
    estimate = max(_ints((*args, *kwargs.values())), default=0)
    if isinstance(owner, (str, bytes)):
        if name == "expandtabs":
            estimate = len(owner) * max(estimate, 8)
        elif name == "replace" and len(args) >= 2:
            estimate = _replace_estimate(budget, owner, args[0], args[1])
        elif name == "join" and args:
            items = list(args[0])
            args = (items, *args[1:])
            estimate = len(owner) * len(items) + sum(budget.size(i) for i in items)
        elif name == "translate" and args and isinstance(args[0], Mapping):
            estimate = len(owner) * (1 + max((budget.size(v) for v in args[0].values()), default=0))
    return estimate, args


# --------------------------------------------------------------------------- filters, tests, globals
def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False) -> str:
    """transformers' ``tojson``: ``json.dumps`` with these options (no HTML escaping, unlike Jinja's)."""
    if indent is None and separators is None:
        return json.dumps(value, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    # Indentation and separators multiply the size: encode piece by piece, within the budget.
    budget, parts, length = active_budget(), [], 0
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    for part in encoder.iterencode(value):
        length += len(part)
        budget.afford(length, "tojson")
        parts.append(part)
    return "".join(parts)


@jinja2.pass_environment
def _sum(environment: jinja2.Environment, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's ``sum``, adding lists or tuples one step at a time within the budget."""
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    items = list(iterable)
    if isinstance(start, (str, bytes)) or all(isinstance(i, (int, float)) for i in (start, *items)):
        return sum(items, start)  # numbers exactly as Python adds them; strings refused as Python does
    total = start
    for item in items:
        total = environment.call_binop(None, "+", total, item)
    return total


def _indent_estimate(budget: Budget, text: Any, width: Any = 4, *_: Any, **__: Any) -> int:
    prefix = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    lines = text.count("\n") + 1 if isinstance(text, str) else budget.size(text)
    return budget.size(text) + prefix * lines


def _wordwrap_estimate(budget: Budget, text: Any, width: Any = 79, brk: Any = True, wrap: Any = None, *_, **kw):
    wrap = kw.get("wrapstring", wrap)
    length = budget.size(text)
    per_line = width if isinstance(width, int) and width > 0 else 1
    breaks = length // per_line + (text.count("\n") if isinstance(text, str) else length) + 1
    return length + breaks * (len(wrap) if isinstance(wrap, str) else 1)


def _join_args(budget: Budget, args: list, kwargs: dict) -> int:
    items = list(args[0]) if args else []
    args[0:1] = [items]
    sep = kwargs.get("d", args[1] if len(args) > 1 else "")
    return budget.size(sep) * len(items) + sum(budget.size(i) for i in items)


def _batch_estimate(budget: Budget, value: Any, count: Any = 0, fill: Any = None, *_: Any, **kw: Any) -> int:
    fill = kw.get("fill_with", fill)
    return 0 if fill is None or not isinstance(count, int) else count * (8 + budget.size(fill))


def _urlize_estimate(budget: Budget, text: Any, *args: Any, **kwargs: Any) -> int:
    extra = sum(budget.size(v) for v in (*args, *kwargs.values()) if isinstance(v, str))
    return budget.size(text) * (2 + extra)


# Filters whose result can be a multiple of their arguments' sizes: (budget, args after any
# environment/context argument, kwargs) -> the size it could reach. _join_args also lists the items.
_FILTER_ESTIMATES = {
    "indent": lambda b, a, k: _indent_estimate(b, *a, **k),
    "wordwrap": lambda b, a, k: _wordwrap_estimate(b, *a, **k),
    "replace": lambda b, a, k: _replace_estimate(b, *(a + [k.get("old"), k.get("new")])[:3]),
    "format": lambda b, a, k: _printf_estimate(b, a[0] if a else "", k or tuple(a[1:])),
    "join": _join_args,
    "batch": lambda b, a, k: _batch_estimate(b, *a, **k),
    "urlize": lambda b, a, k: _urlize_estimate(b, *a, **k),
}


def _guard_filter(name: str, func: Any, is_test: bool) -> Any:
    takes_env = getattr(func, "jinja_pass_arg", None) is not None  # set by pass_environment / pass_context...
    estimate = None if is_test else _FILTER_ESTIMATES.get(name)

    @functools.wraps(func)  # keeps Jinja's pass_context/pass_environment marks
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = active_budget()
        budget.check()
        if is_test:
            return func(*args, **kwargs)
        head, rest = list(args[: 1 + takes_env]), list(args[1 + takes_env :])
        size = max(_ints((*rest, *kwargs.values())), default=0)  # widths, counts: sizes the result may reach
        if estimate is not None:
            value_and_rest = head[takes_env:] + rest
            size = max(size, estimate(budget, value_and_rest, kwargs))
            head, rest = head[:takes_env] + value_and_rest[:1], value_and_rest[1:]
        budget.afford(size, f"the {name} filter")
        return budget.built(func(*head, *rest, **kwargs))

    return guarded


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """The ``dict`` global: builds dicts, but exposes no class to climb out of the sandbox from."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """``namespace()`` without underscore-named attributes (which could shadow Namespace internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature: ``self`` can be an attribute name
        self, values = args[0], dict(*args[1:], **kwargs)
        for name in values:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        active_budget().size(value, held=True)  # refuses namespaces nested in it (see Budget.size)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: names cannot start with '_'")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# --------------------------------------------------------------------------- the environment
class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``~``, displays and for-loop iterables going through the environment."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.kiln_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _built(self, visit: Any, node: nodes.Node, frame: Any) -> None:
        self.write("environment.kiln_built(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Any) -> None:
        self._built(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Any) -> None:
        self._built(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Any) -> None:
        if node.ctx == "load":
            self._built(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        node.iter = nodes.Call(
            nodes.EnvironmentAttribute("kiln_iterate"), [node.iter], [], None, None, lineno=node.iter.lineno
        )
        super().visit_For(node, frame)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the bounds of the active render (see the module doc)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(ImmutableSandboxedEnvironment.default_binop_table)

    def __init__(self) -> None:
        # transformers' settings, so templates render exactly as apply_chat_template renders them.
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters["sum"] = _sum
        self.filters = {name: _guard_filter(name, f, False) for name, f in self.filters.items()}
        self.tests = {name: _guard_filter(name, f, True) for name, f in self.tests.items()}
        del self.globals["lipsum"]  # random paragraphs of any size; no chat template needs them
        self.globals.update(
            range=self.kiln_range,
            dict=_TemplateDict(),
            namespace=_TemplateNamespace,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
        )
        self.finalize = self.kiln_output
        self.concat = self.kiln_join  # blocks, macros and {% set %} blocks join their output with it

    # -- the sandbox's hooks
    def getattr(self, obj: Any, attribute: str) -> Any:
        active_budget().check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        active_budget().check()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = active_budget()
        budget.afford(_binop_estimate(budget, operator, left, right), f"the {operator!r} operator")
        result = self.binop_table[operator](left, right)
        if isinstance(result, int):
            _int_bits(budget, result.bit_length())
        return budget.built(result)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = active_budget()
        budget.charge(CALL_COST)
        if not self.is_safe_callable(obj):
            raise jinja2.exceptions.SecurityError(f"{obj!r} is not safely callable")
        method = obj.__dict__.get("__wrapped__") if isinstance(obj, types.FunctionType) else obj
        if isinstance(method, (types.BuiltinMethodType, types.MethodType)) and isinstance(
            method.__self__, (str, bytes, int)
        ):  # str's, bytes' and int's methods, and Markup's Python wrappers of them
            data = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
            if method.__name__ in ("format", "format_map") and isinstance(method.__self__, str):
                values = [*args, *data.values()]
                if method.__name__ == "format_map" and args and isinstance(args[0], Mapping):
                    values = list(args[0].values())
                estimate = _format_estimate(budget, method.__self__, values)
            else:
                estimate, args = _method_call(budget, method, args, data)
            budget.afford(estimate, f"{method.__name__}()")
        budget.depth += 1
        try:
            if budget.depth > budget.limits.max_call_depth:
                budget.trip(f"calls nested deeper than {budget.limits.max_call_depth} (runaway recursion?)")
            result = context.call(obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        return budget.built(result)

    # -- the environment attributes the code generator calls
    def kiln_range(self, *args: int) -> range:
        items, limit = range(*args), active_budget().limits.max_range
        try:
            count = len(items)
        except OverflowError:  # more items than fit a C size
            count = limit + 1
        if count > limit:
            active_budget().trip(f"range() has more than {limit} items")
        return items

    def kiln_iterate(self, iterable: Any) -> Guarded:
        return Guarded(iterable, active_budget())

    def kiln_built(self, value: Any) -> Any:
        active_budget().charge(active_budget().size(value))
        return value

    def kiln_concat(self, parts: tuple) -> str:
        budget = active_budget()
        # str() of a container may be somewhat longer than its size counts
        budget.afford(sum(len(p) if isinstance(p, str) else 2 * budget.size(p) for p in parts), "the '~' operator")
        return budget.built("".join(map(str, parts)))

    def kiln_join(self, parts: Any) -> str:
        parts = list(parts)
        budget = active_budget()
        budget.afford(sum(len(p) for p in parts), "a block's output")
        return budget.built("".join(parts))

    def kiln_output(self, value: Any) -> Any:
        active_budget().charge(active_budget().size(value))
        return value


_SANDBOX = _BoundedSandbox()


@functools.lru_cache(maxsize=64)
def _compiled(source: str) -> jinja2.Template:
    return _SANDBOX.from_string(source)


def parse_template(source: str, limits: RenderLimits = DEFAULT_LIMITS) -> nodes.Template:
    """The template's syntax tree (for inspection); raises ``jinja2.TemplateSyntaxError`` or, for a
    template over the size limit, :class:`ChatTemplateError`."""
    _check_length(source, limits)
    return _SANDBOX.parse(source)


def _check_length(source: str, limits: RenderLimits) -> None:
    if len(source) > limits.max_template_chars:
        raise ChatTemplateError(f"the template is longer than {limits.max_template_chars} characters")


def render_template(source: str, variables: dict[str, Any], limits: RenderLimits = DEFAULT_LIMITS) -> str:
    """Render ``source`` with ``variables`` in the bounded sandbox; any failure is a :class:`ChatTemplateError`."""
    budget = Budget(limits)
    token = ACTIVE_BUDGET.set(budget)
    try:
        _check_length(source, limits)
        inputs = sum(budget.size(value) for value in variables.values())  # learnt once, not charged
        budget.max_work += INPUT_WORK * inputs
        max_output = limits.max_output_chars + inputs
        template = _compiled(source)  # inside the budget: constant folding runs filters at compile time
        chunks, length = [], 0
        for chunk in template.generate(variables):
            length += len(chunk)
            if length > max_output:
                budget.trip(f"its output is longer than {max_output} characters")
            chunks.append(chunk)
        return "".join(chunks)
    except ChatTemplateError:
        raise
    except TemplateBoundError as exc:
        raise ChatTemplateError(f"rendering stopped: {exc}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"not a valid template (line {exc.lineno}): {exc.message}") from None
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"the template did something unsafe: {exc}") from None
    except RecursionError:
        raise ChatTemplateError("rendering stopped: recursion too deep") from None
    except MemoryError:
        raise ChatTemplateError("rendering stopped: out of memory") from None
    except Exception as exc:  # the template's own error (raise_exception, a type error...): the input's fault
        raise ChatTemplateError(f"the chat template failed: {exc}", param="messages") from None
    finally:
        ACTIVE_BUDGET.reset(token)
