{{/* Names ------------------------------------------------------------------------------------------- */}}
{{- define "trainguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "trainguard.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "trainguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "trainguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "trainguard.labels" -}}
helm.sh/chart: {{ include "trainguard.chart" . }}
{{ include "trainguard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trainguard
{{- end -}}

{{/* labels of one component: (dict "root" $ "component" "gateway") */}}
{{- define "trainguard.componentSelector" -}}
{{ include "trainguard.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "trainguard.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "trainguard.flinkImage" -}}
{{- printf "%s:%s" .Values.flink.image.repository (.Values.flink.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "trainguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "trainguard.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "trainguard.tokensSecret" -}}
{{- .Values.tokens.existingSecret | default (printf "%s-tokens" (include "trainguard.fullname" .)) -}}
{{- end -}}

{{- define "trainguard.claimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-data" (include "trainguard.fullname" .)) -}}
{{- end -}}

{{/* A new token in the server's format tg_<kind>_<16 hex>_<48 hex> (randAlphaNum reads crypto/rand). */}}
{{- define "trainguard.newToken" -}}
{{- printf "tg_%s_%s_%s" . (sha256sum (randAlphaNum 64) | trunc 16) (sha256sum (randAlphaNum 64) | trunc 48) -}}
{{- end -}}

{{/* "true" when mode=split runs on shared state only -- Kafka, PostgreSQL, Elasticsearch, ClickHouse --
     so no pod opens a file another pod opens: no one-node affinity, no shared volume (values.yaml). */}}
{{- define "trainguard.sharedState" -}}
{{- $v := .Values -}}
{{- if and (eq $v.mode "split") (eq $v.queue.type "kafka") (eq $v.stateStore.type "postgres") (eq $v.eventStore.type "elasticsearch") (eq $v.metricStore.type "clickhouse") -}}
true
{{- end -}}
{{- end -}}

{{/* Values that no schema can express: rendering fails with a message that says what to set. */}}
{{- define "trainguard.validate" -}}
{{- $v := .Values -}}
{{- if eq $v.queue.type "kafka" -}}
{{- $_ := required "queue.type=kafka needs queue.kafka.bootstrapServers (host:port[,host:port...] of the brokers)" $v.queue.kafka.bootstrapServers -}}
{{- end -}}
{{- if and (eq $v.mode "split") (ne $v.queue.type "kafka") -}}
{{- fail "mode=split runs gateway, processor and api as separate pods, which hand batches over through Kafka: set queue.type=kafka and queue.kafka.bootstrapServers (the SQLite queue serves one process: use mode=embedded)" -}}
{{- end -}}
{{- if and (eq $v.mode "split") (not $v.persistence.enabled) (not (include "trainguard.sharedState" .)) -}}
{{- fail "mode=split needs persistence.enabled=true: the three pods share the SQLite data directory (tokens, runs, incidents) on one volume (or put every store on a server: stateStore.type=postgres, eventStore.type=elasticsearch, metricStore.type=clickhouse)" -}}
{{- end -}}
{{- $pg := $v.stateStore.postgres -}}
{{- if and (eq $v.stateStore.type "postgres") (not $pg.dsn) (not $pg.dsnKey) -}}
{{- fail "stateStore.type=postgres needs stateStore.postgres.dsn, or .existingSecret with .dsnKey" -}}
{{- end -}}
{{- if and $pg.dsn $pg.dsnKey -}}
{{- fail "give stateStore.postgres.dsn or stateStore.postgres.dsnKey, not both" -}}
{{- end -}}
{{- if and (or $pg.dsnKey $pg.passwordKey) (not $pg.existingSecret) -}}
{{- fail "stateStore.postgres.dsnKey / .passwordKey name keys of stateStore.postgres.existingSecret: set it" -}}
{{- end -}}
{{- if and (gt (int $v.processor.replicas) 1) (ne $v.processor.runtime "embedded") -}}
{{- fail "processor.replicas > 1 needs processor.runtime=embedded: with processor.runtime=flink the Flink job scales (flink.parallelism)" -}}
{{- end -}}
{{- if and (eq $v.processor.runtime "flink") (ne $v.queue.type "kafka") -}}
{{- fail "processor.runtime=flink needs queue.type=kafka: the Flink job reads the gateway's Kafka topic" -}}
{{- end -}}
{{- if eq $v.eventStore.type "elasticsearch" -}}
{{- $_ := required "eventStore.type=elasticsearch needs eventStore.elasticsearch.hosts (comma-separated URLs)" $v.eventStore.elasticsearch.hosts -}}
{{- end -}}
{{- $ch := $v.metricStore.clickhouse -}}
{{- if and (eq $v.metricStore.type "clickhouse") (not $ch.url) (not $ch.urlKey) (not $ch.host) -}}
{{- fail "metricStore.type=clickhouse needs metricStore.clickhouse.url, or .host, or .existingSecret with .urlKey" -}}
{{- end -}}
{{- if and (or $ch.urlKey $ch.passwordKey) (not $ch.existingSecret) -}}
{{- fail "metricStore.clickhouse.urlKey / .passwordKey name keys of metricStore.clickhouse.existingSecret: set it" -}}
{{- end -}}
{{- $es := $v.eventStore.elasticsearch.auth -}}
{{- if and (or $es.apiKeyKey $es.usernameKey $es.passwordKey) (not $es.existingSecret) -}}
{{- fail "eventStore.elasticsearch.auth.*Key name keys of eventStore.elasticsearch.auth.existingSecret: set it" -}}
{{- end -}}
{{- if and $v.queue.kafka.clientConfig $v.queue.kafka.clientConfigSecret.name -}}
{{- fail "give queue.kafka.clientConfig or queue.kafka.clientConfigSecret, not both" -}}
{{- end -}}
{{- if and $v.tokens.existingSecret (or $v.tokens.ingestToken $v.tokens.readToken) -}}
{{- fail "tokens.existingSecret holds the tokens: leave tokens.ingestToken / tokens.readToken empty" -}}
{{- end -}}
{{- range $name, $_ := $v.settings -}}
{{- if has $name (list "data_dir" "host" "http_port" "grpc_port" "roles" "queue" "event_store" "metric_store" "state_store" "postgres_dsn" "postgres_schema" "postgres_pool_size" "processor_runtime" "bootstrap_project" "bootstrap_ingest_token" "bootstrap_read_token") -}}
{{- fail (printf "settings.%s is set by the chart (mode, queue, eventStore, metricStore, stateStore, processor, tokens, service): use those values" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* secretKeyRef env entry: (list "ENV_NAME" "secret" "key") */}}
{{- define "trainguard.secretEnv" -}}
- name: {{ index . 0 }}
  valueFrom:
    secretKeyRef:
      name: {{ index . 1 }}
      key: {{ index . 2 }}
{{- end -}}

{{/* Kafka client settings (also the Flink job's, which reads TRAINGUARD_KAFKA_CLIENT_CONFIG) */}}
{{- define "trainguard.kafkaClientEnv" -}}
{{- $k := .Values.queue.kafka -}}
{{- if $k.clientConfigSecret.name }}
{{ include "trainguard.secretEnv" (list "TRAINGUARD_KAFKA_CLIENT_CONFIG" $k.clientConfigSecret.name $k.clientConfigSecret.key) }}
{{- else if $k.clientConfig }}
- name: TRAINGUARD_KAFKA_CLIENT_CONFIG
  value: {{ $k.clientConfig | quote }}
{{- end }}
{{- end -}}

{{/* The TRAINGUARD_* environment of every TrainGuard container (Settings fields). */}}
{{- define "trainguard.env" -}}
{{- $v := .Values -}}
- name: TRAINGUARD_DATA_DIR
  value: /var/lib/trainguard
- name: TRAINGUARD_HOST
  value: "0.0.0.0"
- name: TRAINGUARD_BOOTSTRAP_PROJECT
  value: {{ $v.tokens.project | quote }}
{{ include "trainguard.secretEnv" (list "TRAINGUARD_BOOTSTRAP_INGEST_TOKEN" (include "trainguard.tokensSecret" .) $v.tokens.ingestKey) }}
{{ include "trainguard.secretEnv" (list "TRAINGUARD_BOOTSTRAP_READ_TOKEN" (include "trainguard.tokensSecret" .) $v.tokens.readKey) }}
- name: TRAINGUARD_QUEUE
  value: {{ $v.queue.type | quote }}
{{- if eq $v.queue.type "kafka" }}
{{- $k := $v.queue.kafka }}
- name: TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS
  value: {{ $k.bootstrapServers | quote }}
- name: TRAINGUARD_KAFKA_TOPIC
  value: {{ $k.topic | quote }}
{{- if $k.deadLetterTopic }}
- name: TRAINGUARD_KAFKA_DEAD_LETTER_TOPIC
  value: {{ $k.deadLetterTopic | quote }}
{{- end }}
- name: TRAINGUARD_KAFKA_GROUP_ID
  value: {{ $k.groupId | quote }}
- name: TRAINGUARD_KAFKA_RESULTS_TOPIC
  value: {{ $k.resultsTopic | quote }}
- name: TRAINGUARD_KAFKA_PARTITIONS
  value: {{ $k.partitions | quote }}
- name: TRAINGUARD_KAFKA_REPLICATION_FACTOR
  value: {{ $k.replicationFactor | quote }}
- name: TRAINGUARD_KAFKA_RETENTION_MS
  value: {{ $k.retentionMs | int64 | quote }}
- name: TRAINGUARD_KAFKA_CREATE_TOPICS
  value: {{ $k.createTopics | quote }}
{{- include "trainguard.kafkaClientEnv" . }}
{{- end }}
- name: TRAINGUARD_EVENT_STORE
  value: {{ $v.eventStore.type | quote }}
{{- if eq $v.eventStore.type "elasticsearch" }}
{{- $es := $v.eventStore.elasticsearch }}
- name: TRAINGUARD_ELASTICSEARCH_HOSTS
  value: {{ $es.hosts | quote }}
- name: TRAINGUARD_ELASTICSEARCH_INDEX_PREFIX
  value: {{ $es.indexPrefix | quote }}
- name: TRAINGUARD_ELASTICSEARCH_RETENTION_DAYS
  value: {{ $es.retentionDays | quote }}
- name: TRAINGUARD_ELASTICSEARCH_SHARDS
  value: {{ $es.shards | quote }}
- name: TRAINGUARD_ELASTICSEARCH_REPLICAS
  value: {{ $es.replicas | quote }}
- name: TRAINGUARD_ELASTICSEARCH_VERIFY_CERTS
  value: {{ $es.verifyCerts | quote }}
- name: TRAINGUARD_ELASTICSEARCH_MANAGE_TEMPLATE
  value: {{ $es.manageTemplate | quote }}
{{- if $es.caCerts }}
- name: TRAINGUARD_ELASTICSEARCH_CA_CERTS
  value: {{ $es.caCerts | quote }}
{{- end }}
{{- range $env, $key := dict "TRAINGUARD_ELASTICSEARCH_API_KEY" $es.auth.apiKeyKey "TRAINGUARD_ELASTICSEARCH_USERNAME" $es.auth.usernameKey "TRAINGUARD_ELASTICSEARCH_PASSWORD" $es.auth.passwordKey }}
{{- if $key }}
{{ include "trainguard.secretEnv" (list $env $es.auth.existingSecret $key) }}
{{- end }}
{{- end }}
{{- end }}
- name: TRAINGUARD_METRIC_STORE
  value: {{ $v.metricStore.type | quote }}
{{- if eq $v.metricStore.type "clickhouse" }}
{{- $ch := $v.metricStore.clickhouse }}
{{- if $ch.urlKey }}
{{ include "trainguard.secretEnv" (list "TRAINGUARD_CLICKHOUSE_URL" $ch.existingSecret $ch.urlKey) }}
{{- else if $ch.url }}
- name: TRAINGUARD_CLICKHOUSE_URL
  value: {{ $ch.url | quote }}
{{- else }}
- name: TRAINGUARD_CLICKHOUSE_HOST
  value: {{ $ch.host | quote }}
{{- if $ch.port }}
- name: TRAINGUARD_CLICKHOUSE_PORT
  value: {{ $ch.port | quote }}
{{- end }}
- name: TRAINGUARD_CLICKHOUSE_USER
  value: {{ $ch.user | quote }}
- name: TRAINGUARD_CLICKHOUSE_SECURE
  value: {{ $ch.secure | quote }}
{{- if $ch.passwordKey }}
{{ include "trainguard.secretEnv" (list "TRAINGUARD_CLICKHOUSE_PASSWORD" $ch.existingSecret $ch.passwordKey) }}
{{- end }}
{{- end }}
- name: TRAINGUARD_CLICKHOUSE_DATABASE
  value: {{ $ch.database | quote }}
- name: TRAINGUARD_CLICKHOUSE_RETENTION_DAYS
  value: {{ $ch.retentionDays | quote }}
{{- end }}
- name: TRAINGUARD_STATE_STORE
  value: {{ $v.stateStore.type | quote }}
{{- if eq $v.stateStore.type "postgres" }}
{{- $pg := $v.stateStore.postgres }}
{{- if $pg.dsnKey }}
{{ include "trainguard.secretEnv" (list "TRAINGUARD_POSTGRES_DSN" $pg.existingSecret $pg.dsnKey) }}
{{- else }}
- name: TRAINGUARD_POSTGRES_DSN
  value: {{ $pg.dsn | quote }}
{{- end }}
{{- if $pg.passwordKey }}
{{ include "trainguard.secretEnv" (list "PGPASSWORD" $pg.existingSecret $pg.passwordKey) }}
{{- end }}
- name: TRAINGUARD_POSTGRES_SCHEMA
  value: {{ $pg.schema | quote }}
- name: TRAINGUARD_POSTGRES_POOL_SIZE
  value: {{ $pg.poolSize | quote }}
{{- end }}
- name: TRAINGUARD_PROCESSOR_RUNTIME
  value: {{ $v.processor.runtime | quote }}
{{- range $name, $value := $v.settings }}
{{- $text := $value | toString }}
{{- if and (kindIs "float64" $value) (eq (float64 (int64 $value)) $value) }}
{{- $text = int64 $value | toString }}
{{- end }}
- name: {{ printf "TRAINGUARD_%s" (upper $name) }}
  value: {{ $text | quote }}
{{- end }}
{{- with $v.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Probes on a named container port: (dict "root" $ "port" "http") */}}
{{- define "trainguard.probes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  httpGet: {path: /healthz, port: {{ .port }}}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds }}
livenessProbe:
  httpGet: {path: /healthz, port: {{ .port }}}
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds }}
readinessProbe:
  httpGet: {path: /readyz, port: {{ .port }}}
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds }}
{{- end -}}

{{/* Container fields shared by every TrainGuard container: image, env, security, mounts.
     (dict "root" $ "roles" "processor,api") -- roles: TRAINGUARD_ROLES for `serve`, optional */}}
{{- define "trainguard.containerCommon" -}}
{{- $root := .root -}}
image: {{ include "trainguard.image" $root | quote }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
env:
{{- include "trainguard.env" $root | nindent 2 }}
{{- with .roles }}
  - name: TRAINGUARD_ROLES
    value: {{ . | quote }}
{{- end }}
securityContext:
{{- toYaml $root.Values.securityContext | nindent 2 }}
volumeMounts:
  - name: data
    mountPath: /var/lib/trainguard
  - name: tmp
    mountPath: /tmp
{{- with $root.Values.extraVolumeMounts }}
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Pod labels: (dict "root" $ "component" "gateway") */}}
{{- define "trainguard.podLabels" -}}
{{ include "trainguard.labels" .root }}
app.kubernetes.io/component: {{ .component }}
trainguard.io/data-volume: {{ include "trainguard.fullname" .root }}
{{- with .root.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod-level fields shared by every TrainGuard pod. In mode=split every pod that mounts the data volume
     must run on the node of the others (SQLite WAL, see values.yaml): a required pod affinity on the
     label trainguard.io/data-volume (the first pod matches its own term, so it schedules anywhere) --
     unless every store is a server (trainguard.sharedState): then no affinity and an emptyDir data dir. */}}
{{- define "trainguard.podCommon" -}}
serviceAccountName: {{ include "trainguard.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.automountServiceAccountToken }}
securityContext:
{{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := deepCopy (.Values.affinity | default dict) }}
{{- $shared := include "trainguard.sharedState" . }}
{{- if and (eq .Values.mode "split") (not $shared) }}
{{- $podAffinity := get $affinity "podAffinity" | default dict }}
{{- $required := get $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default list }}
{{- $term := dict "labelSelector" (dict "matchLabels" (dict "trainguard.io/data-volume" (include "trainguard.fullname" .))) "topologyKey" "kubernetes.io/hostname" }}
{{- $_ := set $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" (append $required $term) }}
{{- $_ := set $affinity "podAffinity" $podAffinity }}
{{- end }}
{{- with $affinity }}
affinity:
{{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: data
{{- if and .Values.persistence.enabled (not $shared) }}
    persistentVolumeClaim:
      claimName: {{ include "trainguard.claimName" . }}
{{- else }}
    emptyDir: {}
{{- end }}
  - name: tmp
    emptyDir: {}
{{- with .Values.extraVolumes }}
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
