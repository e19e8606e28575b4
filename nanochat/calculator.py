"""
The Engine's calculator tool: evaluates a model-written expression without Python's eval, or refuses it.

When a sample writes <|python_start|> expression <|python_end|>, the Engine forces <|output_start|> result
<|output_end|> into it. Arithmetic and a few string methods, walked node by node over Python's parse tree: nothing
a model writes may run code, read files or exhaust the machine (every intermediate result is bounded in size,
every expression in time).
"""

import ast
import math
import operator
import time

MAX_EXPRESSION_CHARS = 1000  # longer expressions are refused before parsing
MAX_STRING_CHARS = 1000  # longest string any step may produce ("ab" * 10**9 is refused before it is built)
MAX_INT_BITS = 4000  # largest integer any step may produce (~1200 digits; 9**9**9 is refused before it is computed)
CALCULATOR_TIME_LIMIT = 0.1  # seconds per expression, checked at every node of the expression
# str methods the calculator calls: only replace can return a string longer than its inputs (checked before)
STRING_METHODS = {"count", "upper", "lower", "strip", "lstrip", "rstrip", "replace", "startswith", "endswith",
                  "find", "title", "capitalize", "swapcase"}
ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class _Refused(Exception):
    """An expression the calculator does not evaluate."""


def _is_number(value):
    return type(value) in (int, float)  # not bool: True + True is not arithmetic anyone means


def _checked(value):
    """A value within the calculator's limits, or _Refused."""
    if type(value) is int and value.bit_length() > MAX_INT_BITS:
        raise _Refused("integer too large")
    if type(value) is float and not math.isfinite(value):
        raise _Refused("not a finite number")
    if type(value) is str and len(value) > MAX_STRING_CHARS:
        raise _Refused("string too long")
    if type(value) not in (int, float, str, bool):
        raise _Refused(f"{type(value).__name__} values are not supported")
    return value


def _binary(op, a, b):
    """a <op> b for numbers (and str + str, str * int), with the size of the result bounded *before* computing it."""
    if _is_number(a) and _is_number(b):
        if op is ast.Mult and type(a) is int and type(b) is int and a.bit_length() + b.bit_length() > MAX_INT_BITS:
            raise _Refused("product too large")
        if op is ast.Pow and type(b) is int and abs(a) > 1:  # |a| <= 1: the power stays small whatever b is
            # |a| >= 2**(bit_length - 1), so a**b has at least (bit_length - 1) * b bits
            if abs(b) > MAX_INT_BITS or (type(a) is int and (a.bit_length() - 1) * b > MAX_INT_BITS):
                raise _Refused("power too large")
        return _checked(ARITHMETIC[op](a, b))
    if op is ast.Add and type(a) is str and type(b) is str:
        return _checked(a + b)
    if op is ast.Mult and {type(a), type(b)} == {str, int}:
        text, count = (a, b) if type(a) is str else (b, a)
        if len(text) * count > MAX_STRING_CHARS:
            raise _Refused("string too long")
        return text * count
    # everything else, notably str % ...: printf-style formatting ("%*d" % (10**9, 1)) is not arithmetic
    raise _Refused(f"unsupported operands for {op.__name__}: {type(a).__name__}, {type(b).__name__}")


def _call_method(text, name, args):
    if name == "replace":
        if len(args) not in (2, 3) or type(args[0]) is not str or type(args[1]) is not str:
            raise _Refused("replace(old, new[, count]) takes two strings")
        old, new = args[0], args[1]
        hits = len(text) + 1 if old == "" else text.count(old)
        if len(args) == 3 and type(args[2]) is int and args[2] >= 0:
            hits = min(hits, args[2])
        if len(text) + hits * (len(new) - len(old)) > MAX_STRING_CHARS:
            raise _Refused("string too long")
    return _checked(getattr(text, name)(*args))


def _evaluate(node, deadline):
    """Evaluate one node of the parsed expression; anything not listed here is refused."""
    if time.monotonic() > deadline:
        raise _Refused("time limit")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, deadline)
        if not _is_number(value):
            raise _Refused("unary + and - apply to numbers")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        return _binary(type(node.op), _evaluate(node.left, deadline), _evaluate(node.right, deadline))
    if isinstance(node, ast.Call) and not node.keywords:
        func = node.func
        if isinstance(func, ast.Name) and func.id == "len" and len(node.args) == 1:
            value = _evaluate(node.args[0], deadline)
            if type(value) is str:
                return len(value)
        elif isinstance(func, ast.Attribute) and func.attr in STRING_METHODS:
            text = _evaluate(func.value, deadline)
            if type(text) is str:
                return _call_method(text, func.attr, [_evaluate(arg, deadline) for arg in node.args])
    raise _Refused(f"not allowed: {type(node).__name__}")


def use_calculator(expr, time_limit=CALCULATOR_TIME_LIMIT):
    """
    The calculator tool: the result of `expr` as Python would print it (str(value)), or None when the
    expression is not one the calculator evaluates, fails (1/0), or exceeds a limit.

    What it evaluates, by walking the parsed expression itself (never eval/exec): int, float and str
    literals; + - * / // % ** and unary + -, on numbers (plus str + str and str * int); parentheses;
    len(str); and the string methods in STRING_METHODS called on a string ('strawberry'.count('r')).
    Nothing else: no names, attribute access other than those methods, subscripts, comprehensions,
    lambdas, keyword arguments. Every intermediate value is bounded (MAX_INT_BITS, MAX_STRING_CHARS) before
    it is computed, so 9**9**9 or 'a' * 10**9 are refused at once, and the walk stops after `time_limit`
    seconds. Commas are removed from expressions without quotes, as thousands separators ("1,200*3").
    """
    if not isinstance(expr, str) or len(expr) > MAX_EXPRESSION_CHARS:
        return None
    expr = expr.strip()
    if "'" not in expr and '"' not in expr:
        expr = expr.replace(",", "")
    try:
        tree = ast.parse(expr, mode="eval")
        return str(_evaluate(tree.body, time.monotonic() + time_limit))
    except Exception:  # refused, a syntax error, 1/0, an overflow, nesting too deep for the parser: no result
        return None
