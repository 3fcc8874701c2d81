"""Figures logged to TensorBoard at the end of each epoch. matplotlib is imported by the first figure (rank 0 of a
ViT run, at its first validation), not by every rank at start-up (0.4 s each)."""


def generate_images(inp, tar, gen, channel=2):
    """Target and prediction of sample 0 side by side (channel 2 = t2m)."""
    import matplotlib
    matplotlib.use("Agg")  # no display on compute nodes
    import matplotlib.pyplot as plt
    target = tar[0, channel].detach().float().cpu().numpy()
    prediction = gen[0, channel].detach().float().cpu().numpy()
    fig, axes = plt.subplots(1, 2, figsize=(12, 6))
    fig.suptitle("2m temperature")
    for ax, image, title in zip(axes, (target, prediction), ("ERA5 target", "ViT prediction")):
        ax.imshow(image, cmap="turbo", vmin=target.min(), vmax=target.max())
        ax.set_title(title)
        ax.axis("off")
    fig.tight_layout()
    return fig


def get_figure(params, inp, tar, gen):
    """(TensorBoard tag, figure) for the config's model, or None."""
    if params.get("model", "vit") == "vit":
        return "Visualization, t2m", generate_images(inp, tar, gen)
    return None
