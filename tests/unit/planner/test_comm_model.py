"""AxoNN eqs. 1-9: the model equals the equations computed by hand, and the bandwidth hierarchy of Sec. V."""
import pytest
import yaml

from jaxhybrid.planner.comm_model import Network, comm_time, group_bandwidths, layer_comm_time, layer_comm_volumes

# (m, k, n, G_c, G_r, G_d, G_data)
CASES = [(1024, 512, 2048, 2, 2, 2, 2), (4096, 4096, 12288, 4, 2, 1, 8), (512, 768, 768, 1, 1, 8, 1),
         (2048, 1024, 4096, 8, 1, 1, 1), (64, 64, 64, 1, 1, 1, 16)]


@pytest.mark.parametrize("m,k,n,gc,gr,gd,gdata", CASES)
@pytest.mark.parametrize("transposed", [False, True])
def test_volumes_equal_eqs_4_to_8_by_hand(m, k, n, gc, gr, gd, gdata, transposed):
    if transposed:  # optimization A: swap G_r and G_c (and their groups)
        c, r = gr, gc
    else:
        c, r = gc, gr
    v = layer_comm_volumes(m, k, n, gc, gr, gd, gdata, transposed=transposed)
    assert v["all_gather"].wire_elems == pytest.approx((gd - 1) * k * n / (c * r * gd))            # eq. 4
    assert v["reduce_scatter"].wire_elems == pytest.approx((gd - 1) / gd * k * n / (c * r))        # eq. 5
    assert v["all_reduce_fwd"].wire_elems == pytest.approx(2 * (r - 1) / r * m * n / (gd * c))     # eq. 6
    assert v["all_reduce_bwd"].wire_elems == pytest.approx(2 * (c - 1) / c * m * k / (gd * r))     # eq. 7
    assert v["all_reduce_data"].wire_elems == pytest.approx(2 * (gdata - 1) / gdata * k * n / (c * r * gd))
    assert v["all_reduce_fwd"].axis == ("col" if transposed else "row")
    assert v["all_reduce_bwd"].axis == ("row" if transposed else "col")


def test_eq9_time_sums_collectives_with_given_bandwidths():
    m, k, n, gc, gr, gd, gdata = 1024, 512, 2048, 2, 4, 2, 2
    bw = {"col": 100.0, "row": 50.0, "depth": 25.0, "data": 10.0}
    t = comm_time(layer_comm_volumes(m, k, n, gc, gr, gd, gdata), bw, bytes_per_elem=2)
    by_hand = (2 * (gd - 1) * k * n / (gc * gr * gd) / 25 + 2 * (gd - 1) / gd * k * n / (gc * gr) / 25
               + 2 * 2 * (gr - 1) / gr * m * n / (gd * gc) / 50 + 2 * 2 * (gc - 1) / gc * m * k / (gd * gr) / 100
               + 2 * 2 * (gdata - 1) / gdata * k * n / (gc * gr * gd) / 10)
    assert t["total"] == pytest.approx(by_hand)


def test_bandwidth_hierarchy_intra_then_inter_divided_by_inner_product():
    net = Network(gpus_per_node=4, intra_node=((2, 300.0), (4, 200.0)), inter_node=64.0)
    bw = group_bandwidths(net, G_c=2, G_r=2, G_d=4, G_data=2)
    assert bw["col"] == 300.0   # span 2 inside a node
    assert bw["row"] == 200.0   # stride 2, span 4: still one node
    assert bw["depth"] == 64.0 / 4  # crosses nodes; 4 inner rings contend (min(4, 4))
    assert bw["data"] == 64.0 / 4   # cp_inner = 16 capped at gpus_per_node
    # Innermost group larger than a node: the full beta_inter (Fig. 4).
    assert group_bandwidths(net, G_c=8, G_r=1, G_d=1)["col"] == 64.0
    assert group_bandwidths(net, G_c=1, G_r=8, G_d=1)["row"] == 64.0  # size-1 levels do not count


def test_hardware_files_have_bandwidths_and_sources():
    for name in ("perlmutter", "frontier", "summit", "h100-node"):
        hw = yaml.safe_load(open(f"configs/hardware/{name}.yaml"))
        net = Network.from_hardware(hw)
        assert net.inter_node > 0 and net.host_to_device > 0 and hw["sources"]
        assert set(hw["peak_tflops"]) == {"float32", "bfloat16", "float16"}
        t = layer_comm_time(4096, 4096, 16384, 2, 2, 2, 2, net)
        assert t["total"] > 0


def test_hardware_files_carry_the_papers_machines():
    """The figures the papers state for their machines, which their models are scored on. AxoNN VI: a
    Perlmutter node has 4 A100s of 40 GB at 312 TFLOP/s half precision and 4 NICs of 200 Gb/s (beta_inter);
    a Frontier node 4 MI250X (8 GCDs, the file's GPUs) of 128 GB and 383 TFLOP/s each, and the same NICs.
    Myelin VI: a Summit node has 6 V100s of 16 GB at 125 TFLOP/s half precision, 50 GB/s between GPUs of a
    node (NVLink, the 3 of a socket). Its 12.5 GB/s inter-node figure is one of the node's two EDR rails;
    the file counts both (AxoNN's beta_inter is a node pair's, summit.yaml says so)."""
    hw = {n: yaml.safe_load(open(f"configs/hardware/{n}.yaml")) for n in ("perlmutter", "frontier", "summit")}
    nets = {n: Network.from_hardware(h) for n, h in hw.items()}
    nic = 200e9 / 8  # bytes/s of one 200 Gb/s Slingshot-11 NIC
    p, f, s = hw["perlmutter"], hw["frontier"], hw["summit"]
    assert (p["gpus_per_node"], float(p["memory_bytes"]), p["peak_tflops"]["float16"]) == (4, 40e9, 312.0)
    assert nets["perlmutter"].inter_node == 4 * nic
    assert (f["gpus_per_node"], 2 * float(f["memory_bytes"]), 2 * f["peak_tflops"]["float16"]) == (8, 128e9, 383.0)
    assert nets["frontier"].inter_node == 4 * nic
    assert (s["gpus_per_node"], float(s["memory_bytes"]), s["peak_tflops"]["float16"]) == (6, 16e9, 125.0)
    assert nets["summit"].intra_bandwidth(3) == 50e9 and nets["summit"].inter_node == 2 * 12.5e9


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="G_r"):
        layer_comm_volumes(16, 16, 16, 1, 0, 1)
    with pytest.raises(ValueError, match="bandwidth"):
        Network.from_hardware({"name": "cpu", "gpus_per_node": 1})
