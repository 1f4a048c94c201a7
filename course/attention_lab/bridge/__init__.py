"""The trust boundary of grading: the student's kernel and the trusted checker talk in data.

In the lab a check runs in the student's own kernel, as it always did.  In grading the same
check runs in another process, the trusted checker (``autograder.grading.trusted.checker``), and
reaches the student's functions, classes and modules through this bridge: the checker sends
requests ("call split_heads with these tensors"), the kernel's agent
(:mod:`attention_lab.bridge.kernel_side`) answers with data (:mod:`attention_lab.bridge.wire`).
The student's code never runs where a verdict is made, and nothing it sends is ever executed,
imported or unpickled there.
"""
