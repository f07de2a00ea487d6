# md helpers for the rig's guest scripts (md-reverse.guest.sh, md-ppl.guest.sh): shipped as
# /rig/md-lib.sh (`rig.sh initramfs --file`) and sourced after /rig/lib.sh. MD_TAG names
# the caller in what it prints.

t() { cut -d' ' -f1 /proc/uptime; }
say() { echo "$MD_TAG [$(t)s]: $*"; }
fail() {
	echo "$MD_TAG: FAIL: $*"
	cat /proc/mdstat
	exit 1
}

# True when /proc/mdstat shows a resync, recovery or check on md device $1 (name).
busy() {
	grep -A3 "^$1 :" /proc/mdstat | grep -Eq 'resync|recovery|check|reshape|PENDING|DELAYED'
}

# Waits until md has nothing to do on $1 (no resync/recovery/check running or pending).
wait_idle() {
	_n=${1#/dev/} _i=0
	while :; do
		_a=$(cat "/sys/block/$_n/md/sync_action")
		_r=$(cat "/sys/block/$_n/md/resync_start")
		if [ "$_a" = idle ] && [ "$_r" = none ] && ! busy "$_n"; then
			return 0
		fi
		_i=$((_i + 1))
		[ $_i -le 600 ] || fail "$1 still busy after 300 s (sync_action=$_a resync_start=$_r)"
		sleep 0.5
	done
}

# md's check over the whole array; its mismatch_cnt goes to $2 and must be 0.
md_check() {
	_n=${1#/dev/}
	echo check >"/sys/block/$_n/md/sync_action"
	sleep 0.5
	wait_idle "$1"
	[ "$(cat "/sys/block/$_n/md/last_sync_action")" = check ] || fail "$1: md ran no check"
	cat "/sys/block/$_n/md/mismatch_cnt" >"$2"
	[ "$(cat "$2")" = 0 ] || fail "$1: md's check found mismatch_cnt $(cat "$2") on ferroraid's parity"
}
