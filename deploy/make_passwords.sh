#!/bin/sh
# Create a Mosquitto password file for N FedSketch clients (c01..cN) and the server,
# and the server's Ed25519 signing key pair.
#
#   usage: deploy/make_passwords.sh N [PASSWORD_FILE] [PREFIX] [W]
#   e.g.:  sudo deploy/make_passwords.sh 20 /etc/mosquitto/fedsketch.passwd
#          sudo deploy/make_passwords.sh 20 /etc/mosquitto/fedsketch.passwd c 4
#
# W: the server's ingest workers (fedsketch-server --ingest-workers W): the
# users server-ingest-0 .. server-ingest-<W-1>, with the server's password
# (deploy/acl names up to 8 of them; deploy/make_acl.py writes one for more).
#
# Signing key: unless they exist already, fedsketch-server.key (private, mode
# 600: for fedsketch-server --signing-key) and fedsketch-server.pub (for every
# device: fedsketch-client --server-key) are written to $KEY_DIR (default: the
# current folder). A device given the .pub obeys only what the server signed.
# Keep the .key on the server alone; an existing pair is never replaced (every
# device would need the new .pub).
#
# Each user gets a random password, printed ONCE on standard output as
# "user password" lines: copy each client's password to its Pi (for example
# into /etc/fedsketch/password, mode 600, used with --password-file) and keep
# the list somewhere safe. The file itself holds only salted hashes.
# Running it again replaces the file and every password.
set -eu

if [ $# -lt 1 ] || [ $# -gt 4 ]; then
    echo "usage: $0 N [PASSWORD_FILE] [PREFIX] [W]" >&2
    exit 2
fi
n=$1
file=${2:-fedsketch.passwd}
prefix=${3:-c}
workers=${4:-0}
case $n in
    ''|*[!0-9]*) echo "N must be a positive integer, got '$n'" >&2; exit 2 ;;
esac
case $workers in
    ''|*[!0-9]*) echo "W (ingest workers) must be an integer >= 0, got '$workers'" >&2; exit 2 ;;
esac
if [ "$n" -lt 1 ]; then
    echo "N must be at least 1" >&2
    exit 2
fi
command -v mosquitto_passwd >/dev/null 2>&1 || {
    echo "mosquitto_passwd not found: sudo apt install mosquitto" >&2
    exit 1
}

width=${#n}
[ "$width" -lt 2 ] && width=2

random_password() {
    # 24 characters from the kernel's random source, no symbols to escape.
    LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 24
}

umask 077
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT

server_password=$(random_password)
echo "server $server_password" >>"$tmp"
i=0
while [ "$i" -lt "$workers" ]; do
    echo "server-ingest-$i $server_password" >>"$tmp"
    i=$((i + 1))
done
i=1
while [ "$i" -le "$n" ]; do
    printf '%s%0*d %s\n' "$prefix" "$width" "$i" "$(random_password)" >>"$tmp"
    i=$((i + 1))
done

# Plain "user:password" lines, then hashed in place by mosquitto_passwd -U.
sed 's/ /:/' "$tmp" >"$file"
mosquitto_passwd -U "$file"
chmod 600 "$file"

key_dir=${KEY_DIR:-.}
if [ ! -e "$key_dir/fedsketch-server.key" ]; then
    command -v openssl >/dev/null 2>&1 || { echo "openssl not found: sudo apt install openssl" >&2; exit 1; }
    openssl genpkey -algorithm ed25519 -out "$key_dir/fedsketch-server.key"
    chmod 600 "$key_dir/fedsketch-server.key"
    openssl pkey -in "$key_dir/fedsketch-server.key" -pubout -out "$key_dir/fedsketch-server.pub"
    chmod 644 "$key_dir/fedsketch-server.pub"
    echo "wrote the server's signing key $key_dir/fedsketch-server.key and its public half" \
         "$key_dir/fedsketch-server.pub (copy it to every device)" >&2
fi

cat "$tmp"
echo "wrote $((n + 1 + workers)) users to $file (hashed); the passwords above are not stored anywhere else" >&2
