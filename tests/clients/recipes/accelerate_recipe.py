"""accelerate: ``dist.init_process_group("loco")`` before ``Accelerator()`` (it reuses the
group; its own backend argument takes only the device's default); metrics with
``accelerator.log``. ``python accelerate_recipe.py BACKEND`` under torchrun."""

import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

import lowbitcc
from tests.clients.recipes.common import dataset, model, report

dist.init_process_group(sys.argv[1])
accelerator = Accelerator(cpu=True)
net = model()
opt = torch.optim.SGD(net.parameters(), lr=0.05)
data = torch.utils.data.DataLoader(dataset(), batch_size=16)
net, opt, data = accelerator.prepare(net, opt, data)
metrics = lowbitcc.StepMetrics()
logged: dict = {}
for x, y in data:
    loss = nn.functional.mse_loss(net(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    logged = metrics.collect()
    accelerator.log(logged)
if accelerator.is_main_process:
    report(dist.get_backend(), float(loss), list(logged))
