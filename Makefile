# gluon-fl: `make help` lists the targets by group. Every target with a `## ` comment names its
# group first, `## [reproduce|study|operate|develop] what it does`; tests/test_docs.py checks it.
SHELL := /bin/bash
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where datasets live (libsvm/a5a, cifar10-jpeg/...): found as the README says (data_dir=,
# GLUON_DATA_DIR, ./data, ../shared/data; a5a is downloaded into ./data when it is nowhere).
# The Makefile sets no folder of its own: GLUON_DATA_DIR=DIR in the environment or on make's
# command line points elsewhere (make passes either on to the runs).
# Offline experiment tracking unless asked otherwise.
WANDB_MODE ?= offline
export WANDB_MODE
# Sweeps: LAUNCHER=basic (default) runs the jobs one by one in-process; LAUNCHER=local runs
# JOBS submitit jobs at a time here (about 5 s start-up each); LAUNCHER=slurm sends them to a cluster.
JOBS ?= 2
LAUNCHER ?= basic
export GLUON_JOBS := $(JOBS)
# e.g. make fig3 LAUNCHER=slurm PARTITION=cpu TIME=120 (more settings: docs/slurm.md)
ifdef PARTITION
export GLUON_SLURM_PARTITION := $(PARTITION)
endif
ifdef TIME
export GLUON_SLURM_TIME := $(TIME)
endif
LOGREG_SWEEP = $(PY) -m experiments.logreg -m launcher=$(LAUNCHER)
# CNN runs last minutes, so even locally they run JOBS at a time (submitit); GPU jobs on SLURM.
CNN_LAUNCHER ?= $(if $(filter basic,$(LAUNCHER)),local,$(if $(filter slurm,$(LAUNCHER)),slurm_gpu,$(LAUNCHER)))
CNN_SWEEP = $(PY) -m experiments.cnn -m launcher=$(CNN_LAUNCHER)
# The CNN panel's profile: paper scale when a GPU is visible, else the CPU profile (widths 16/64/64, a budget of 500 dense gradients).
CNN_PROFILE ?= $(shell $(PY) -c "import torch; print('paper' if torch.cuda.is_available() else 'cpu')" 2>/dev/null || echo cpu)
TUNED_LOGREG = configs/tuned/fig2_logreg
TUNED_CNN = configs/tuned/fig2_cnn_cpu

.PHONY: help install test test-slow bench bench-cnn gpu-check logreg fig2 fig2-logreg fig2-cnn fig2-plot \
        tune-fig2 tune-fig2-cnn \
        fig3 fig4 fig5 fig6 fig7 fig8 cnn-gap cnn-gap-gpu cnn-gap-gpu-runs sbatch-preview wandb-sync clean

help:  ## [operate] list the targets by group: reproduce, study, operate, develop
	@awk 'BEGIN { n = split("reproduce study operate develop", order, " "); for (i = 1; i <= n; i++) known[order[i]] = 1; \
	    about["reproduce"] = "the paper'"'"'s figures and tables"; \
	    about["study"] = "beyond the paper: tuning, fair baselines, the CNN gap, the network cost"; \
	    about["operate"] = "set-up, sweeps, clusters, W&B, clean-up"; \
	    about["develop"] = "tests, benchmarks, checks"; about["ungrouped"] = "no [group] in its ## comment" } \
	  /^[a-z0-9-]+:.*## / { t = $$0; sub(/:.*/, "", t); d = substr($$0, index($$0, "## ") + 3); g = "ungrouped"; \
	    if (match(d, /^\[[a-z]+\] /)) { g = substr(d, 2, RLENGTH - 3); d = substr(d, RLENGTH + 1) } \
	    if (!(g in known)) { g = "ungrouped"; d = substr($$0, index($$0, "## ") + 3) } \
	    line[g, ++count[g]] = sprintf("  make %-15s %s", t, d) } \
	  END { order[++n] = "ungrouped"; for (i = 1; i <= n; i++) { g = order[i]; if (!count[g]) continue; \
	    printf "%s%s: %s\n", (shown++ ? "\n" : ""), g, about[g]; for (j = 1; j <= count[g]; j++) print line[g, j] } }' $(MAKEFILE_LIST)

# Two targets started at once in a fresh clone (a sweep and a figure, say) both need .venv: the
# set-up runs under a lock where flock exists (Linux), and the second finds it done.
LOCK := $(shell command -v flock >/dev/null 2>&1 && echo flock .venv.lock)
$(STAMP): pyproject.toml
	$(LOCK) sh -c 'test $(STAMP) -nt pyproject.toml && exit 0; \
	  { test -x $(PY) || $(PY_SYS) -m venv $(VENV); } && \
	  $(PY) -m pip install -q --upgrade pip && \
	  $(PY) -m pip install -q -e ".[experiments,test]" && touch $(STAMP)'

install: $(STAMP)  ## [operate] create .venv and install the project with its pinned dependencies

# Test processes (pytest-xdist; auto: one per core). A test file stays in one process, so the
# tests of one file never race on what they share (the shaped-network namespace, module fixtures).
TEST_JOBS ?= auto
test: $(STAMP)  ## [develop] run the test suite (fast tests; about 13 minutes on 2 cores)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

test-slow: $(STAMP)  ## [develop] run every test, the slow end-to-end ones included
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile -m 'slow or not slow'

bench: $(STAMP)  ## [develop] throughput benchmark of every method on a5a (steps/s, where the time goes); f* at each BLAS thread count
	$(PY) -m scripts.bench.bench_logreg
	$(PY) -m scripts.bench.bench_fstar --out results/bench/fstar.md

bench-cnn: $(STAMP)  ## [develop] CNN step time on CPU: where it goes, for every method make fig-cost re-costs (results/bench/cnn.md); reference vs fast path at both widths, B = 4 and 64, and two runs at once at three widths (cnn_paths*.md)
	$(PY) -m scripts.bench.bench_cnn --out results/bench/cnn.md
	$(PY) -m scripts.bench.bench_cnn --paths --methods gluon alg1 --out results/bench/cnn_paths.md
	$(PY) -m scripts.bench.bench_cnn --paths --methods alg1 --B 64 --path-steps 100 --out results/bench/cnn_paths_b64.md
	$(PY) -m scripts.bench.bench_cnn --paths --methods alg1 --B 64 --path-steps 50 --concurrent 2 \
	  --path-widths 16 64 64 --path-widths 32 128 128 --path-widths 64 256 256 --out results/bench/cnn_paths_b64_pair.md

.PHONY: bench-optim
bench-optim: $(STAMP)  ## [develop] gluon.optim on CPU: DDP + SGD momentum vs Gluon q = 1 (2 gloo processes), the optimiser's own overhead, results/bench/optim.md
	$(PY) -m scripts.bench.bench_optim --out results/bench/optim.md

gpu-check: $(STAMP)  ## [develop] on a GPU: CNN methods at paper scale, bf16 vs fp32 Delta, steps/s, gloo vs simulation, the LM's GPT (<5 min)
	$(PY) -m scripts.bench.gpu_check

logreg: $(STAMP)  ## [reproduce] one a5a run of Algorithm 1 (RandK 1%), into results/runs/example
	@$(PY) -m experiments.logreg method=alg1 compressor=randk compressor.density=0.01 \
	  method.q=0.1 method.B=4 method.beta=0.99 method.lr=0.01 steps=10000 seed=0 \
	  hydra.run.dir=results/runs/example

tune-fig2: $(STAMP)  ## [study] re-tune every Fig. 2 a5a method (grids in configs/experiment/tune_fig2/), rewrite configs/tuned/
	for m in gluon vr_marina ef21_muon alg1 alg2 alg3 alg4; do $(LOGREG_SWEEP) experiment=tune_fig2/$$m || exit 1; done
	$(PY) -m scripts.analysis.select_tuned --sweep $$($(PY) -m experiments.run.sweep dir logreg tune_fig2/gluon) --out $(TUNED_LOGREG) \
	  --table results/tune_fig2/scores.csv

tune-fig2-cnn: $(STAMP)  ## [study] re-tune the quick CNN profile's methods (CNN_PROFILE=cpu_quick; seed 100), rewrite configs/tuned/fig2_cnn_cpu/
	for m in gluon alg1 alg2 ef21_muon; do $(CNN_SWEEP) experiment=tune_fig2_cnn/$$m || exit 1; done
	$(PY) -m scripts.analysis.select_tuned --sweep $$($(PY) -m experiments.run.sweep dir cnn tune_fig2_cnn/gluon) --out $(TUNED_CNN) \
	  --metric loss --table results/tune_fig2_cnn/scores.csv

fig2-logreg: $(STAMP)  ## [reproduce] Fig. 2 a5a panel: 7 tuned methods x 10 seeds, curves, reduction table, figure
	$(LOGREG_SWEEP) experiment=fig2_logreg
	$(PY) -m scripts.figures.fig2 aggregate --task logreg
	$(PY) -m scripts.figures.fig2 plot

# The CPU panel is the CNN-gap study's reference condition (re-tuned, B = 64, 5 seeds): its runs
# are committed, so a clone reads them (recomputing them takes about 3.5 hours on 2 cores);
# cpu_quick recomputes the panel at the settings before the study (B = 4, 3 seeds) in about 35 minutes.
FIG2_CNN_EXPERIMENT = $(if $(filter cpu,$(CNN_PROFILE)),cnn_gap/panel,fig2_cnn_$(patsubst %_quick,%,$(CNN_PROFILE)))
fig2-cnn: $(STAMP)  ## [reproduce] Fig. 2 CNN panel (paper scale with a GPU; else the CNN-gap study's CPU panel; CNN_PROFILE=paper|cpu|cpu_quick)
	$(CNN_SWEEP) experiment=$(FIG2_CNN_EXPERIMENT)
	if [ "$(FIG2_CNN_EXPERIMENT)" != fig2_cnn_cpu ]; then \
	  $(CNN_SWEEP) experiment=$(FIG2_CNN_EXPERIMENT) tuned=fig2_cnn_cpu/ef21_muon steps=60000 \
	    max_grads=$$($(PY) -m scripts.figures.cnn_gap grads-cap \
	      --sweep $$($(PY) -m experiments.run.sweep dir cnn $(FIG2_CNN_EXPERIMENT))) || exit 1; fi   # EF21-Muon at Alg. 1's compute
	$(PY) -m scripts.figures.fig2 aggregate --task cnn --experiment $(FIG2_CNN_EXPERIMENT)
	$(PY) -m scripts.figures.fig2 plot

# Does this machine reproduce Fig. 2's a5a panel? Its runs go into results/runs/verify/ (ignored
# by git; finished ones are skipped); results/fig2/ is left as committed. Exit 1 if a reduction
# leaves its committed interval.
VERIFY_DIR ?= results/runs/verify
.PHONY: verify
verify: $(STAMP)  ## [reproduce] regenerate Fig. 2's a5a panel in results/runs/verify/, check its reductions against the committed intervals (about 4 min on 2 cores)
	$(LOGREG_SWEEP) experiment=fig2_logreg hydra.sweep.dir=$(VERIFY_DIR)/fig2_logreg
	$(PY) -m scripts.analysis.verify --sweep $(VERIFY_DIR)/fig2_logreg --out $(VERIFY_DIR)/fig2

fig2-plot: $(STAMP)  ## [reproduce] redraw figures/fig2.{png,pdf} from the committed CSVs in results/fig2/
	$(PY) -m scripts.figures.fig2 plot

fig2: fig2-logreg fig2-cnn  ## [reproduce] the paper's main figure, both panels

# What compression buys (docs/fair.md): Figure 2's methods against fair dense baselines
# (large-batch Gluon, Local Gluon) and EF21-Muon re-tuned, read at equal uplink and at equal
# compute. EF21-Muon's cap is Alg. 1's gradient evaluations over the uplink budget, read from
# the uplink panel's Alg. 1 runs (so the commands below that use it run after them); the compute
# reading's budget is fixed in configs/experiment/fair_logreg/_compute.yaml.
.PHONY: fair fair-runs fair-cnn-runs
FAIR_CAP_LOGREG = $$($(PY) -m scripts.figures.fair grads-cap --task logreg)
FAIR_SELECT_LOGREG = $(PY) -m scripts.analysis.select_tuned --sweep $$($(PY) -m experiments.run.sweep dir logreg \
	  fair_logreg/tune_alg1) --out configs/tuned/fair_logreg --table results/fair/tune_scores_logreg.csv \
	  --strict --stop method.B=1024   # B = 1,024: a5a's full local gradient up to sampling (docs/fair.md)
fair: $(STAMP)  ## [study] what compression buys: figures/fig2_fair.png, results/fair/decomposition.{csv,md} from the committed runs (docs/fair.md)
	$(PY) -m scripts.figures.fair aggregate
	$(PY) -m scripts.figures.fair plot

fair-runs: $(STAMP)  ## [study] the fair-baseline runs on a5a, at equal uplink and at equal compute: tuning grids, 10 seeds a method (skips finished runs; hours on 2 cores)
	for m in large_batch_gluon large_batch_gluon_edges large_batch_gluon_b1024 large_batch_gluon_lines \
	         local_gluon local_gluon_edges local_gluon_q0003 local_gluon_lines local_gluon_lines_beta \
	         local_gluon_q003 local_gluon_q003_beta local_gluon_beta08_q local_gluon_beta08_lr \
	         alg1 alg1_b1024 alg1_lines alg2 alg2_lines alg2_b1024; do \
	  $(LOGREG_SWEEP) experiment=fair_logreg/tune_$$m || exit 1; done
	$(FAIR_SELECT_LOGREG)    # stops here while a choice sits on a grid edge: extend that grid first
	$(LOGREG_SWEEP) experiment=fair_logreg/uplink tuned=fair_logreg/alg1      # Alg. 1's gradient count: the cap
	for g in tune_ef21_muon tune_ef21_muon_edges tune_ef21_muon_lines; do \
	  $(LOGREG_SWEEP) experiment=fair_logreg/$$g max_grads=$(FAIR_CAP_LOGREG) || exit 1; done
	$(FAIR_SELECT_LOGREG)
	$(LOGREG_SWEEP) experiment=fair_logreg/uplink
	$(LOGREG_SWEEP) experiment=fair_logreg/uplink tuned=fair_logreg/ef21_muon steps=200000 max_grads=$(FAIR_CAP_LOGREG)
	$(LOGREG_SWEEP) experiment=fair_logreg/uplink tuned=fair_logreg/alg1 compressor.density=0.1   # 0.1% is 1% on a5a (k = 1)
	for g in tune_compute_large_batch_gluon tune_compute_large_batch_gluon_edges; do \
	  $(LOGREG_SWEEP) experiment=fair_logreg/$$g || exit 1; done
	$(PY) -m scripts.analysis.select_tuned --x grads --sweep $$($(PY) -m experiments.run.sweep dir logreg \
	  fair_logreg/tune_compute_large_batch_gluon) --out configs/tuned/fair_logreg_compute \
	  --table results/fair/tune_compute_scores_logreg.csv
	$(LOGREG_SWEEP) experiment=fair_logreg/compute

# The CNN half (configs/experiment/fair_cnn/): tuning grids coarse to fine (B = 4 first), then five
# seeds a baseline; Gluon, Alg. 1 and 2 come from the CNN-gap panel (make cnn-gap). Each baseline's
# panel runs as soon as its grid is chosen, so `make fair` reads the CNN baseline by baseline.
# One stage a baseline: a stage whose strict selection stops on a grid edge waits for that grid's
# extension, and `make -k fair-cnn-runs` goes on with the other stages meanwhile.
# Tens of hours on 2 cores (docs/fair.md, Status); every run resumes from its checkpoint and
# finished ones skip.
FAIR_CAP_CNN = $$($(PY) -m scripts.figures.cnn_gap grads-cap)
FAIR_SELECT_CNN = $(PY) -m scripts.analysis.select_tuned --sweep $$($(PY) -m experiments.run.sweep dir \
	  cnn fair_cnn/tune_large_batch_gluon) --out configs/tuned/fair_cnn --metric loss \
	  --table results/fair/tune_scores_cnn.csv --strict --stop method.B=64   # B stops at 64 as Alg. 1's did
FAIR_CNN_STAGES = fair-cnn-large-batch fair-cnn-local fair-cnn-ef21 fair-cnn-density fair-cnn-compute
.PHONY: $(FAIR_CNN_STAGES)
fair-cnn-runs: $(FAIR_CNN_STAGES)  ## [study] the fair-baseline runs on the CNN, at equal uplink and at equal compute: tuning grids, 5 seeds a baseline, one stage each (skips finished runs; -k goes on past a stage waiting for a grid extension; tens of hours on 2 cores)

fair-cnn-large-batch: $(STAMP)
	$(CNN_SWEEP) experiment=fair_cnn/tune_large_batch_gluon
	$(CNN_SWEEP) experiment=fair_cnn/tune_large_batch_gluon_edges   # lr 0.4 at B = 64
	$(FAIR_SELECT_CNN) --only large_batch_gluon   # stops here while its choice sits on a grid edge: extend that grid first
	$(CNN_SWEEP) experiment=fair_cnn/uplink tuned=fair_cnn/large_batch_gluon

fair-cnn-local: $(STAMP)
	$(CNN_SWEEP) experiment=fair_cnn/tune_local_gluon
	$(CNN_SWEEP) experiment=fair_cnn/tune_local_gluon_edges   # beta 0.95 at lr 0.0125 and 0.025
	$(FAIR_SELECT_CNN) --only local_gluon
	$(CNN_SWEEP) experiment=fair_cnn/tune_local_gluon_q tuned=fair_cnn/local_gluon   # q through that choice
	$(FAIR_SELECT_CNN) --only local_gluon
	$(CNN_SWEEP) experiment=fair_cnn/uplink tuned=fair_cnn/local_gluon

fair-cnn-ef21: $(STAMP)
	$(CNN_SWEEP) experiment=fair_cnn/tune_ef21_muon max_grads=$(FAIR_CAP_CNN)
	$(FAIR_SELECT_CNN) --only ef21_muon
	$(CNN_SWEEP) experiment=fair_cnn/uplink tuned=fair_cnn/ef21_muon max_grads=$(FAIR_CAP_CNN)

fair-cnn-density: $(STAMP)   # Alg. 1 at RandK 0.1% and 10%, at the CNN-gap study's tuned settings
	$(CNN_SWEEP) experiment=fair_cnn/uplink tuned=cnn_gap/alg1 compressor.density=0.001,0.1

fair-cnn-compute: $(STAMP)
	$(CNN_SWEEP) experiment=fair_cnn/tune_compute_large_batch_gluon   # equal compute: B = 1 among B
	$(PY) -m scripts.analysis.select_tuned --x grads --sweep $$($(PY) -m experiments.run.sweep dir cnn \
	  fair_cnn/tune_compute_large_batch_gluon) --out configs/tuned/fair_cnn_compute --metric loss \
	  --table results/fair/tune_compute_scores_cnn.csv --strict --stop method.B=64
	$(CNN_SWEEP) experiment=fair_cnn/compute     # the other methods are read off their uplink runs

.PHONY: fig-cost shaped shaped-cnn
fig-cost: $(STAMP)  ## [study] Fig. 2's runs and the fair panels re-costed (docs/cost.md): compute, downlink, modelled wall-clock; figures/fig_cost_*.png, results/cost/crossover.md (no run recomputed)
	$(PY) -m scripts.figures.cost all

shaped: $(STAMP)  ## [study] (root) a real shaped network: Gluon and Alg. 1 on a5a, 2 gloo processes, measured vs modelled (results/cost/shaped.csv; about 9 min; docs/cost.md)
	scripts/cluster/shaped_network.sh up
	$(PY) -m scripts.bench.shaped measure --rates 100kbit 20mbit; rc=$$?; scripts/cluster/shaped_network.sh down; exit $$rc

shaped-cnn: $(STAMP)  ## [study] (root) the same for the CNN's quick CPU profile (B = 4), to its Gluon's final loss (results/cost/shaped_cnn.csv; 40 min on the idle machine)
	scripts/cluster/shaped_network.sh up
	$(PY) -m scripts.bench.shaped measure --task cnn --rates 3mbit 100mbit; rc=$$?; scripts/cluster/shaped_network.sh down; exit $$rc

# The LM study (docs/lm.md): a character-level GPT on Tiny Shakespeare, on the CPU profile
# (nanoGPT's CPU shape) to an uplink budget of 200, for each worker split (LM_SPLITS): the tuning
# grids (seed 100), the tuned settings (configs/tuned/lm_<split>/), EF21-Muon's grid capped
# at Alg. 1's gradient evaluations, then the 5-seed panel. Runs JOBS at a time, like the CNN's.
.PHONY: bench-lm lm lm-runs fig-lm lm-reference
LM_SPLITS ?= iid plays
LM_SWEEP = $(PY) -m experiments.lm -m launcher=$(CNN_LAUNCHER)
# $(1): the split, $(2): its tuning grids' folder under configs/experiment/ (lm, lm/plays),
# $(3): more options (--only: the methods whose grids have run)
LM_SELECT = $(PY) -m scripts.analysis.select_tuned --sweep $$($(PY) -m experiments.run.sweep dir lm \
	  $(2)/tune_gluon) --out configs/tuned/lm_$(1) --metric val_loss --table results/lm/tune_scores_$(1).csv \
	  --strict --stop method.B=64 $(3)   # a choice on a grid edge stops lm-runs before the panel: extend that grid first; B stops at 64 for compute (docs/lm.md)
# One example run: nanoGPT's shakespeare_char GPU shape when a GPU is visible, else the CPU profile.
LM_PROFILE ?= $(shell $(PY) -c "import torch; print('lm/paper' if torch.cuda.is_available() else 'lm/cpu')" 2>/dev/null || echo lm/cpu)
bench-lm: $(STAMP)  ## [develop] LM step time on CPU, where it goes, and the uplink budget an Alg. 1 run fits in 30 minutes of one core (results/bench/lm.md)
	$(PY) -m scripts.bench.bench_lm --out results/bench/lm.md

lm: $(STAMP)  ## [study] one LM run of Algorithm 1 (RandK 1%, B = 16) to 20 units of uplink (paper profile with a GPU, else the CPU profile), into results/runs/lm_example
	@$(PY) -m experiments.lm profile=$(LM_PROFILE) method=alg1 compressor=randk compressor.density=0.01 \
	  method.q=0.1 method.B=16 method.lr=0.001 max_comm=20 seed=0 hydra.run.dir=results/runs/lm_example

lm-runs: $(STAMP)  ## [study] the LM study's runs (docs/lm.md): tuning grids, their edge extensions and the 5-seed panel per worker split; skips finished runs (hours on 2 cores; docs/lm.md)
	for s in $(LM_SPLITS); do t=$$([ $$s = iid ] && echo lm || echo lm/$$s); \
	  for m in gluon gluon_edges alg1 alg1_edges alg1_b1 alg2 alg2_b1 large_batch_gluon large_batch_gluon_edges local_gluon local_gluon_edges; do \
	    $(LM_SWEEP) experiment=$$t/tune_$$m || exit 1; done; \
	  $(call LM_SELECT,$$s,$$t,--only gluon --only alg1 --only alg2 --only large_batch_gluon --only local_gluon) || exit 1; \
	  cap=$$($(PY) -m scripts.figures.lm grads-cap --split $$s --from tune) || exit 1; \
	  own=$$([ $$s != plays ] || echo ef21_muon_low); \
	  for e in ef21_muon ef21_muon_edges $$own; do \
	    $(LM_SWEEP) experiment=$$t/tune_$$e max_grads=$$cap || exit 1; done; \
	  $(call LM_SELECT,$$s,$$t) || exit 1; \
	  $(LM_SWEEP) experiment=lm/panel_$$s || exit 1; \
	  $(LM_SWEEP) experiment=lm/panel_$$s tuned=lm_$$s/ef21_muon \
	    max_grads=$$($(PY) -m scripts.figures.lm grads-cap --split $$s) || exit 1; \
	done

fig-lm: $(STAMP)  ## [study] the LM figure from the committed runs: figures/fig_lm.png, results/lm/{reduction,decomposition}.{csv,md}, the block the README quotes and docs/lm.md's tuning table
	$(PY) -m scripts.figures.lm aggregate
	$(PY) -m scripts.figures.lm plot

lm-reference: $(STAMP)  ## [study] the LM's dense AdamW reference, at the study's token budget and at nanoGPT's CPU example (results/lm/adamw_*.json; minutes)
	$(PY) -m scripts.analysis.lm_reference --preset budget
	$(PY) -m scripts.analysis.lm_reference --preset nanogpt
	$(PY) -m scripts.analysis.lm_shards --out results/lm/shards.md

fig3: $(STAMP)  ## [reproduce] Alg. 1: sync probability q x RandK density (App. G)
	$(LOGREG_SWEEP) experiment=$@
	$(PY) -m scripts.figures.ablation aggregate $@
	$(PY) -m scripts.figures.ablation plot $@

fig4: $(STAMP)  ## [reproduce] Alg. 1: large batch B x RandK density (App. G)
	$(LOGREG_SWEEP) experiment=$@
	$(PY) -m scripts.figures.ablation aggregate $@
	$(PY) -m scripts.figures.ablation plot $@

fig6: $(STAMP)  ## [reproduce] Alg. 2 with TopK: B x density, against Alg. 1 with RandK (App. G)
	$(LOGREG_SWEEP) experiment=fig4   # Alg. 1 with RandK, the dashed lines (Fig. 4's runs; skipped when done)
	$(LOGREG_SWEEP) experiment=$@
	$(PY) -m scripts.figures.ablation aggregate $@
	$(PY) -m scripts.figures.ablation plot $@

fig5: $(STAMP)  ## [reproduce] Alg. 1 learning rate x momentum (Alg. 1's tuning sweep of Fig. 2)
	$(LOGREG_SWEEP) experiment=tune_fig2/alg1
	$(PY) -m scripts.figures.ablation aggregate $@
	$(PY) -m scripts.figures.ablation plot $@

fig7: $(STAMP)  ## [reproduce] VR-MARINA tuning (its tuning sweep of Fig. 2)
	$(LOGREG_SWEEP) experiment=tune_fig2/vr_marina
	$(PY) -m scripts.figures.ablation aggregate $@
	$(PY) -m scripts.figures.ablation plot $@

fig8: $(STAMP)  ## [reproduce] App. H: Alg. 1 on the CNN over q and lr (CPU profile, about 22 min on 2 cores)
	$(CNN_SWEEP) experiment=$@
	$(CNN_SWEEP) experiment=fig2_cnn_cpu tuned=fig2_cnn_cpu/gluon   # the q = 1 baseline (Fig. 2's runs; skipped when done)
	$(PY) -m scripts.figures.ablation aggregate $@
	$(PY) -m scripts.figures.ablation plot $@

sbatch-preview: $(STAMP)  ## [operate] print the sbatch script of a sweep without a cluster: make sbatch-preview EXP=fig3
	$(PY) -m experiments.run.sweep sbatch $(if $(filter fig8 fig2_cnn% tune_fig2_cnn%,$(EXP)),cnn launcher=slurm_gpu,logreg launcher=slurm) experiment=$(EXP)

cnn-gap: $(STAMP)  ## [study] the CNN-gap study (docs/cnn_gap.md): tuning, panel, budget, width ladder; skips finished runs (hours on 2 cores)
	for m in gluon alg1 alg1_edges alg1_b64 alg2 alg2_beta; do $(CNN_SWEEP) experiment=cnn_gap/tune_$$m || exit 1; done
	$(PY) -m scripts.analysis.select_tuned --sweep $$($(PY) -m experiments.run.sweep dir cnn cnn_gap/tune_gluon) \
	  --out configs/tuned/cnn_gap --metric loss \
	  --table results/cnn_gap/tune_scores.csv
	$(CNN_SWEEP) experiment=cnn_gap/panel
	$(CNN_SWEEP) experiment=cnn_gap/panel tuned=fig2_cnn_cpu/ef21_muon steps=60000 \
	  max_grads=$$($(PY) -m scripts.figures.cnn_gap grads-cap)   # EF21-Muon at Alg. 1's compute
	$(CNN_SWEEP) experiment=cnn_gap/panel_old
	$(CNN_SWEEP) experiment=cnn_gap/budget tuned=cnn_gap/gluon   # budget, width: on the CPU fast path
	$(CNN_SWEEP) experiment=cnn_gap/budget_fp32                  # Gluon in fp32 too: the fast path's control at 2,000
	$(CNN_SWEEP) experiment=cnn_gap/budget tuned=cnn_gap/alg1,cnn_gap/alg2 \
	  max_comm=$$($(PY) -m scripts.figures.cnn_gap budget-rule)   # to where Gluon's loss flattens, <= 2,000
	$(CNN_SWEEP) experiment=cnn_gap/width32
	$(PY) -m scripts.figures.cnn_gap finished width64 || $(CNN_SWEEP) experiment=cnn_gap/width64   # or on a GPU (cnn-gap-gpu)
	$(PY) -m scripts.figures.cnn_gap finished width64_lr || for m in gluon alg1 alg2; do \
	  $(CNN_SWEEP) experiment=cnn_gap/width64_lr tuned=cnn_gap/$$m \
	  method.lr=$$($(PY) -m scripts.figures.cnn_gap lr-check $$m) || exit 1; done
	$(PY) -m scripts.figures.cnn_gap aggregate
	$(PY) -m scripts.figures.cnn_gap plot

# The study's width64 condition, its control panel_gpu (the reference on the GPU) and the lr check
# on one GPU instead, every run of a condition at once. CNN_GAP_GPU picks the parts; MPS=0 shares
# the GPU by time-slicing alone.
CNN_GAP_GPU ?= width64 panel_gpu width64_lr
cnn-gap-gpu: $(STAMP)  ## [study] the CNN-gap study's width64, its GPU control and lr check on one GPU, under CUDA MPS (docs/cnn_gap.md)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'error: no CUDA GPU is visible; make cnn-gap runs the whole study on the CPU')"
	scripts/cluster/with_mps.sh $(MAKE) --no-print-directory cnn-gap-gpu-runs
	$(PY) -m scripts.figures.cnn_gap aggregate
	$(PY) -m scripts.figures.cnn_gap plot

GPU_SWEEP = $(PY) -m experiments.cnn -m launcher=local device=cuda
cnn-gap-gpu-runs: $(STAMP)
	for c in $(filter-out width64_lr,$(CNN_GAP_GPU)); do \
	  GLUON_JOBS=15 $(GPU_SWEEP) experiment=cnn_gap/$$c || exit 1; done
ifneq ($(filter width64_lr,$(CNN_GAP_GPU)),)
	pids=; for m in gluon alg1 alg2; do \
	  GLUON_JOBS=2 $(GPU_SWEEP) experiment=cnn_gap/width64_lr tuned=cnn_gap/$$m \
	    method.lr=$$($(PY) -m scripts.figures.cnn_gap lr-check $$m) & pids="$$pids $$!"; \
	done; rc=0; for p in $$pids; do wait $$p || rc=1; done; exit $$rc
endif

.PHONY: summarize
summarize: $(STAMP)  ## [operate] table of every config in a sweep: make summarize SWEEP=results/sweeps/cnn_gap/panel
	@test -n "$(SWEEP)" || { echo "usage: make summarize SWEEP=results/sweeps/<name> [ARGS='--metric loss --sort comm --per-run']" >&2; exit 2; }
	$(PY) -m scripts.analysis.summarize $(SWEEP) $(ARGS)

wandb-sync: $(STAMP)  ## [operate] upload every offline W&B run under results/ (needs internet and WANDB_API_KEY)
	$(VENV)/bin/wandb sync $$(find results -type d -name 'offline-run-*')

.PHONY: test-slurm
test-slurm: $(STAMP)  ## [develop] SLURM for real (root): one-node cluster here, installed if missing; sweep, requeue, re-run, srun
	scripts/cluster/slurm_cluster.sh run -- $(PY) -m pytest -q -m slurm tests/slurm

clean:  ## [operate] remove raw run directories (keeps the committed summaries)
	rm -rf results/runs results/sweeps outputs multirun
