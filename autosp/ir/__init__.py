"""autosp's IR: Var, Eqn, Graph; the printer, verifier, interpreter and lowering."""
from autosp.ir.core import Eqn, Graph, In, Role, Var
from autosp.ir.interpret import eval_graph
from autosp.ir.lower import lower
from autosp.ir.ops import Op, Tag, op_for
from autosp.ir.verify import verify

__all__ = ["Eqn", "Graph", "In", "Op", "Role", "Tag", "Var", "eval_graph", "lower", "op_for", "verify"]
