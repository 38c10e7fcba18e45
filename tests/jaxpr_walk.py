"""Every equation of a traced function's jaxpr, inner ones too (a scan's or a custom_vjp's body, a cond's branches,
a kernel's body): how tests find a kernel's call and its parameters."""

import jax
import jax.extend


def equations(fn, *args) -> list:
    """The equations of jax.make_jaxpr(fn)(*args), outer before inner."""
    return inner_equations(jax.make_jaxpr(fn)(*args).jaxpr)


def inner_equations(jaxpr) -> list:
    """The equations of `jaxpr` and of every jaxpr inside it, outer before inner."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.append(eqn)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)
    walk(jaxpr)
    return found
