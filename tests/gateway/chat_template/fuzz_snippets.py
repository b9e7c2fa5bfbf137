"""Random Jinja programs for the differential check against python3-jinja2 (make_fixtures.py).

Random expressions (literals, names, attribute/item/slice access, operators, filters, tests,
methods, conditional expressions) inside random statements (output, if/else, for/else with loop
variables, set, comments) with random whitespace control, over a fixed context. The generator is
seeded, so the same programs come out on every run; make_fixtures.py keeps those jinja2 renders
without error whose constructs tandem implements the same way (see SKIP).
"""
import random

# Constructs where tandem knowingly differs from jinja2 (both fine for chat templates):
# "| items" on a non-mapping is a lazy generator in jinja2 (no error until iterated) and
# str % non-tuple sequence/mapping follows Python's printf rules tandem does not copy.
SKIP = ("| items", " % ")

CTX = {"s": "Héllo wörld ", "n": 3, "f": 2.5, "l": [1, "a", None, True], "d": {"k": "v", "n": 2},
       "ms": [{"role": "user", "content": "hi "}, {"role": "assistant", "content": None}],
       "e": "", "z": 0, "u8": "ß Σ é Straße", "neg": -7, "big": 10**12, "t": True}
STRS = ["'a'", '"b c"', "'\\n'", "'é'", "''", "'x,y'", "' pad '", "'%s'"]
FILTERS = ["trim", "length", "upper", "lower", "title", "capitalize", "tojson", "default('dflt')",
           "join(',')", "first", "last", "list", "string", "int", "replace('l', 'L')", "items",
           "unique | list", "reverse | list", "tojson(indent=2)", "float", "abs", "count",
           "selectattr('role', 'equalto', 'user') | list", "map(attribute='role') | list",
           "default('x', true)", "trim | length", "select | list", "reject | list"]
TESTS = ["defined", "undefined", "none", "string", "number", "mapping", "sequence", "iterable",
         "integer", "float", "boolean", "true", "false", "odd", "even", "lower", "upper",
         "equalto 3", "eq 'a'", "in [1, 2]", "divisibleby 2", "callable"]
METHODS = ["s.strip()", "s.split()", "s.upper()", "d.get('k')", "d.get('q', 5)", "d.items() | list",
           "s.startswith('H')", "s.replace('l', 'x')", "s.split('l', 1)", "u8.title()", "u8.upper()",
           "s.rstrip()", "s.lstrip('H')", "d.keys() | list", "d.values() | list", "s.endswith(('x', ' '))",
           "ms[0].content.strip()", "s.find('l')", "s.count('l')", "', '.join(['a', 'b'])"]

def atom(R, depth):
    c = R.randrange(12)
    if c == 0: return R.choice(["s", "n", "f", "l", "d", "ms", "e", "z", "u8", "neg", "big", "t", "nope"])
    if c == 1: return str(R.choice([0, 1, 2, 3, -1, 7, 10, 100]))
    if c == 2: return R.choice(["1.5", "0.1", "2.0", "1e3", "3.25", "0.0"])
    if c == 3: return R.choice(STRS)
    if c == 4: return R.choice(["none", "true", "false", "None", "True"])
    if c == 5: return "[" + ", ".join(expr(R, depth + 1) for _ in range(R.randrange(3))) + "]"
    if c == 6: return "{" + ", ".join("'k%d': %s" % (i, expr(R, depth + 1)) for i in range(R.randrange(3))) + "}"
    if c == 7: return R.choice(["d.k", "d['n']", "l[1]", "l[-1]", "s[1:4]", "ms[0].role", "ms[1].content",
                                "s[::-1]", "l[1:]", "d.nope", "l[9]", "ms[0]['content']", "u8[0]", "s[-3:]", "l[::2]"])
    if c == 8: return R.choice(METHODS)
    if c == 9: return "(" + expr(R, depth + 1) + ")"
    if c == 10: return R.choice(["[0, 1]", "[]", "[1, 2, 3]"])
    return "loop_free"

def expr(R, depth=0):
    if depth > 3: return atom(R, depth + 5)
    c = R.randrange(10)
    if c < 3: return atom(R, depth)
    if c == 3: return expr(R, depth + 1) + " | " + R.choice(FILTERS)
    if c == 4: return expr(R, depth + 1) + " is " + R.choice(["", "not "]) + R.choice(TESTS)
    if c == 5: return R.choice(["not ", "-"]) + atom(R, depth + 1)
    if c == 6: return "%s if %s else %s" % (atom(R, depth + 1), expr(R, depth + 1), atom(R, depth + 1))
    op = R.choice(["+", "-", "*", "//", "%", "~", "==", "!=", "<", ">", "<=", ">=", "and", "or", "in", "not in", "/", "**"])
    return "%s %s %s" % (atom(R, depth + 1), op, atom(R, depth + 1))

def ws(R):
    return R.choice(["", " ", "\n", "  \n", "\n    ", "\n\n  ", " x ", "\t"])

def tag(R, body, kind="%"):
    l = R.choice(["", "-", "+"]) if kind == "%" else R.choice(["", "-"])
    r = R.choice(["", "-"])
    return "{" + kind + l + " " + body + " " + r + kind + "}" if kind == "%" else "{{" + l + " " + body + " " + r + "}}"

def stmt(R, depth=0):
    c = R.randrange(6 if depth < 2 else 2)
    if c <= 1: return ws(R) + tag(R, expr(R), "{") + ws(R)
    if c == 2: return ws(R) + tag(R, "if " + expr(R)) + block(R, depth) + R.choice(["", tag(R, "else") + block(R, depth)]) + tag(R, "endif") + ws(R)
    if c == 3: return ws(R) + tag(R, "for x in " + R.choice(["l", "s", "d", "ms", "[]", "nope", "'ab'"]) + R.choice(["", " if x"])) + block(R, depth) + "{{ x }}{{ loop.index }}" + R.choice(["", tag(R, "else") + "E"]) + tag(R, "endfor") + ws(R)
    if c == 4: return ws(R) + tag(R, "set v = " + expr(R)) + ws(R) + "{{ v }}"
    return ws(R) + "{# c #}" + ws(R)

def block(R, depth):
    return "".join(stmt(R, depth + 1) for _ in range(R.randrange(1, 3)))



def programs(seed, count):
    """`count` random template sources and the context they render with."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        out.append("".join(stmt(rng) for _ in range(rng.randrange(1, 4))))
    return out, CTX
