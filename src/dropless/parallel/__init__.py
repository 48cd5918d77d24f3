"""Expert parallelism: token dispatch to the ranks that own the experts, and the weighted combine back."""

from dropless.parallel.data_parallel import expert_data_parallel, expert_fully_shard
from dropless.parallel.dispatch import DispatchHandle, combine, dispatch
from dropless.parallel.symmetric import SymmetricHandle

__all__ = ["DispatchHandle", "SymmetricHandle", "combine", "dispatch", "expert_data_parallel", "expert_fully_shard"]
