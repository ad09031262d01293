"""Oracle for host/hearth/tests/api/accelerator.rs: the string values of Accelerate's
DistributedType, PrecisionType, RNGType and LoggerType, as JSON."""
import json

from accelerate.utils import DistributedType, LoggerType, PrecisionType, RNGType

print(json.dumps({e.__name__: [v.value for v in e] for e in (DistributedType, PrecisionType, RNGType, LoggerType)}))
