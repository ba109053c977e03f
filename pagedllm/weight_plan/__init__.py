"""The one planning pass over a model's weights (plan.py): which format every linear layer,
vocabulary embedding and head, and MoE projection holds. The checkpoint loaders ask it before
streaming which layers keep the checkpoint's blocks; the runner calls it after loading for the
rest. Beside it, the steps' helpers: the CPU's measured linear kernel per shape
(linear_choice.py), the activation mode (activation_choice.py), and the table it returns
(weight_table.py)."""
