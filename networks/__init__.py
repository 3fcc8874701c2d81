"""Model selection by the config's `model` key."""
from utils.errors import UserError


def get_model(params, layout=None):
    """Build the network named by `params.model` (default 'vit'), serial: a layout's split is the recipe's
    (distributed/parallelize.py); with `layout`, a ViT that could not be split that way is refused in one line."""
    name = params.get("model", "vit")
    if name == "vit":
        from networks.vit import ViT
        return ViT(params, layout)
    if name == "unet":
        from networks.UNet import UNet
        return UNet(params)
    if name == "resnet":
        from networks.resnet import ResNet
        return ResNet(params)
    raise UserError(f"model '{name}' is unknown; choose one of: vit, unet, resnet")
